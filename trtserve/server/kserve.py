"""KServe v2 (the Open Inference Protocol) over HTTP, on the same port as the OpenAI routes: health,
server and model metadata, readiness, and `infer` with JSON tensors or the binary tensor data
extension (`Inference-Header-Content-Length`), as Triton serves it and `tritonclient` speaks it.

Encoder engines take their raw inputs and return `last_hidden_state` and `sentence_embedding`
(L2-normalised, as the model's sentence-transformers pipeline and /v1/embeddings give it), through
the same dynamic batcher and limits as /v1/embeddings. Decoder engines describe themselves but
refuse `infer`: they serve generation on the OpenAI routes. Errors are the protocol's
`{"error": "..."}` with the matching status. Each engine has one version, "1"."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import zlib

import numpy as np
from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from trtserve import __version__
from trtserve.engine_dir.kinds import ModelKind
from trtserve.server.errors import BadRequest, ModelNotFound, PayloadTooLarge, ServingError, Unavailable
from trtserve.server.http import PROBE_EVERY, V2_PREFIX, serving, unless_disconnected, v2_error

PREFIX = V2_PREFIX
VERSION = "1"
HEADER_LENGTH = "inference-header-content-length"
MAX_OUTPUT_BYTES = 64 * 1024 * 1024  # the tensors one answer may carry as binary data
MAX_JSON_OUTPUT_BYTES = 4 * 1024 * 1024  # ... and as JSON numbers (about 5x as much text)
DATATYPES = {"BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
             "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64", "FP16": "float16",
             "FP32": "float32", "FP64": "float64"}
V2_NAMES = {v: k for k, v in DATATYPES.items()}
ENCODER_OUTPUTS = ("last_hidden_state", "sentence_embedding")


class _Tensor(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    shape: list[int] = Field(max_length=8)
    datatype: str
    parameters: dict | None = None
    data: list | None = None


class _Output(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    parameters: dict | None = None


class InferRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    inputs: list[_Tensor] = Field(min_length=1)
    outputs: list[_Output] | None = None
    parameters: dict | None = None


router = APIRouter()


def _engine(raw: Request, name: str, version: str | None = None):
    registry = serving(raw).engines()
    service = registry.services.get(name)
    if service is None:
        raise ModelNotFound(f"model `{name}` is not served here; this server serves {registry.names()}")
    if version is not None and version != VERSION:
        raise ModelNotFound(f"model `{name}` has version {VERSION} only, not {version!r}")
    return service


def _v2(handler):
    """The handler with errors in the protocol's shape ({"error": message})."""
    @functools.wraps(handler)
    async def wrapped(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except ServingError as exc:
            return v2_error(exc)
    return wrapped


@router.get("/v2/health/live")
async def live():
    return {"live": True}


@router.get("/v2/health/ready")
@_v2
async def ready(raw: Request):
    down = serving(raw).engines().unhealthy(3 * PROBE_EVERY)
    if down:
        raise Unavailable("; ".join(f"`{n}`: {why}" for n, why in down.items()))
    return {"ready": True}


@router.get("/v2")
async def server_metadata():
    return {"name": "trtserve", "version": __version__, "extensions": ["binary_tensor_data"]}


async def model_metadata(name: str, raw: Request, version: str | None = None):
    return metadata(name, _engine(raw, name, version))


async def model_ready(name: str, raw: Request, version: str | None = None):
    service = _engine(raw, name, version)
    if not service.healthy(3 * PROBE_EVERY):
        raise Unavailable(f"model `{name}` is not ready: a worker is restarting or has not answered a probe")
    return {"name": name, "ready": True}


async def infer(name: str, raw: Request, version: str | None = None):
    state = serving(raw)
    service = _engine(raw, name, version)
    body = _decoded(await raw.body(), raw.headers.get("content-encoding", ""), state.cfg.max_body_bytes)
    request, tensors = parse(body, raw.headers.get(HEADER_LENGTH))
    if service.kind == ModelKind.SCORER:
        raise BadRequest(f"model `{name}` is a cross-encoder: it scores pairs on /v1/rerank, /rerank and /v1/score, "
                         "and does not serve KServe v2 `infer`")
    if service.kind != ModelKind.ENCODER:
        raise BadRequest(f"model `{name}` is a decoder engine: it generates text on /v1/completions and "
                         "/v1/chat/completions, and does not serve KServe v2 `infer`")
    wanted = requested_outputs(request)
    answer = await unless_disconnected(raw, encoder_infer(service, tensors, wanted), state.metrics)
    if isinstance(answer, Response):  # the client went away
        return answer
    header, blobs = await asyncio.to_thread(_rendered, name, request.id, answer, wanted)  # not on the loop
    if not blobs:
        return Response(header, media_type="application/json")
    return Response(header + b"".join(blobs), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(header))})


for _path, _handler, _method in ((PREFIX + "/models/{name}", model_metadata, "GET"),
                                 (PREFIX + "/models/{name}/ready", model_ready, "GET"),
                                 (PREFIX + "/models/{name}/infer", infer, "POST")):
    for _route in (_path, _path.replace("{name}", "{name}/versions/{version}")):
        router.add_api_route(_route, _v2(_handler), methods=[_method], include_in_schema=_route == _path)


def metadata(name: str, service) -> dict:
    platform = {"tensorrt": "tensorrt_plan", "openvino": "openvino"}.get(service.served_by[0], "onnxruntime_onnx")

    def described(tensors):
        return [{"name": t.name, "datatype": V2_NAMES.get(t.dtype, t.dtype.upper()),
                 "shape": [d if isinstance(d, int) else -1 for d in t.shape]} for t in tensors]

    if service.kind == ModelKind.ENCODER:
        io = service.manifest.io
        return {"name": name, "versions": [VERSION], "platform": platform,
                "inputs": described(io.inputs), "outputs": described(io.outputs)}
    return {"name": name, "versions": [VERSION], "platform": platform, "inputs": [], "outputs": [],
            "parameters": {"kind": service.kind, "note": "pairs are scored on /v1/rerank, /rerank and /v1/score; "
                           "infer is refused" if service.kind == ModelKind.SCORER else "generation is served on "
                           "/v1/completions and /v1/chat/completions; infer is refused"}}


def _decoded(body: bytes, encoding: str, limit: int) -> bytes:
    """The body, inflated if the client compressed it (gzip or deflate), never beyond `limit` bytes."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise BadRequest(f"Content-Encoding {encoding!r} is not accepted; send gzip, deflate or none")
    inflater = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib, by their headers
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise BadRequest(f"the {encoding} body does not inflate: {exc}") from None
    if len(out) > limit:
        raise PayloadTooLarge(f"the inflated request body is over the limit of {limit} bytes")
    return out


def parse(body: bytes, header_length: str | None) -> tuple[InferRequest, dict[str, np.ndarray]]:
    """The request's JSON and its input tensors, from JSON `data` or the binary part of the body."""
    if header_length is None:
        head, rest = body, b""
    else:
        if not re.fullmatch(r"[0-9]{1,12}", header_length.strip()) or int(header_length) > len(body):
            raise BadRequest(f"Inference-Header-Content-Length is {header_length!r}; it must be the byte length "
                             f"of the JSON at the start of the body ({len(body)} bytes)")
        head, rest = body[: int(header_length)], body[int(header_length):]
    try:
        request = InferRequest.model_validate_json(head)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise BadRequest(f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}") from None
    tensors, offset = {}, 0
    for t in request.inputs:
        if t.name in tensors:
            raise BadRequest(f"input `{t.name}` is given twice")
        if t.datatype not in DATATYPES:
            raise BadRequest(f"input `{t.name}` has datatype {t.datatype!r}; this server takes "
                             f"{', '.join(DATATYPES)}")
        if any(d < 0 for d in t.shape):
            raise BadRequest(f"input `{t.name}` has shape {t.shape}: dimensions cannot be negative")
        dtype = np.dtype(DATATYPES[t.datatype]).newbyteorder("<")
        count = int(np.prod(t.shape, dtype=np.float64))
        size = (t.parameters or {}).get("binary_data_size")
        if size is not None:
            if t.data is not None:
                raise BadRequest(f"input `{t.name}` has both `data` and a binary_data_size")
            if not isinstance(size, int) or isinstance(size, bool) or size != count * dtype.itemsize:
                raise BadRequest(f"input `{t.name}`: binary_data_size is {size!r}, but shape {t.shape} of "
                                 f"{t.datatype} takes {count * dtype.itemsize} bytes")
            if offset + size > len(rest):
                raise BadRequest(f"input `{t.name}`: the body ends before its {size} bytes of binary data")
            tensors[t.name] = np.frombuffer(rest, dtype, count, offset).reshape(t.shape)
            offset += size
        elif t.data is None:
            raise BadRequest(f"input `{t.name}` has neither `data` nor a binary_data_size parameter")
        else:
            tensors[t.name] = _from_json(t, dtype, count)
    if offset != len(rest):
        raise BadRequest(f"the body has {len(rest) - offset} bytes of binary data that no input claims")
    return request, tensors


def _from_json(t: _Tensor, dtype: np.dtype, count: int) -> np.ndarray:
    try:
        values = np.asarray(t.data)
    except ValueError:
        raise BadRequest(f"input `{t.name}`: `data` is a ragged nested list") from None
    kind = values.dtype.kind
    fits = (kind in "iu" and dtype.kind in "iu") or (kind == "b" and dtype.kind == "b") or \
        (kind in "iuf" and dtype.kind == "f")
    if values.size and not fits:
        raise BadRequest(f"input `{t.name}`: `data` holds {values.dtype.name} values, not {t.datatype}")
    if values.size != count:
        raise BadRequest(f"input `{t.name}`: `data` has {values.size} values; shape {t.shape} takes {count}")
    if values.size and dtype.kind in "iu":
        info = np.iinfo(dtype)
        if values.min() < info.min or values.max() > info.max:
            raise BadRequest(f"input `{t.name}`: a value is outside the range of {t.datatype}")
    return values.astype(dtype).reshape(t.shape)


def requested_outputs(request: InferRequest) -> list[tuple[str, bool]]:
    """(output name, as binary data) in the order they were asked for; all outputs by default."""
    default = bool((request.parameters or {}).get("binary_data_output", False))
    if request.outputs is None:
        return [(name, default) for name in ENCODER_OUTPUTS]
    names = [o.name for o in request.outputs]
    unknown = [n for n in names if n not in ENCODER_OUTPUTS]
    if unknown:
        raise BadRequest(f"unknown output `{unknown[0]}`; this model returns {', '.join(ENCODER_OUTPUTS)}")
    if len(set(names)) < len(names):
        raise BadRequest("an output is requested twice")
    if not names:
        raise BadRequest("`outputs` is empty: name at least one, or leave it out for all")
    return [(o.name, bool((o.parameters or {}).get("binary_data", default))) for o in request.outputs]


def encoder_rows(service, tensors: dict[str, np.ndarray]) -> list[list[int]]:
    """Token-id rows from an encoder's raw inputs: `input_ids` (B, S), right-padded per
    `attention_mask` (1s then 0s; all 1s when left out); `token_type_ids` all zeros if given."""
    allowed = {"input_ids", "attention_mask", "token_type_ids"}
    unknown = sorted(set(tensors) - allowed)
    if unknown:
        raise BadRequest(f"unknown input `{unknown[0]}`; this model takes {', '.join(sorted(allowed))}")
    if "input_ids" not in tensors:
        raise BadRequest("input `input_ids` is missing")
    ids = tensors["input_ids"]
    for name, tensor in tensors.items():
        if tensor.dtype.kind not in "iu":
            raise BadRequest(f"input `{name}` is {V2_NAMES[tensor.dtype.name]}; this model takes INT64 (or INT32)")
        if tensor.shape != ids.shape or tensor.ndim != 2:
            raise BadRequest(f"input `{name}` has shape {list(tensor.shape)}; every input must be [batch, sequence] "
                             f"like input_ids {list(ids.shape)}")
    batch, length = ids.shape
    if batch == 0 or length == 0:
        raise BadRequest(f"input_ids has shape {list(ids.shape)}: give at least one row of one token")
    if length > service.max_seq:
        raise BadRequest(f"input_ids has {length} tokens per row; this engine's limit is {service.max_seq}")
    if batch > service.cfg.max_queue:
        raise BadRequest(f"input_ids has {batch} rows; this server queues at most {service.cfg.max_queue} "
                         "(--max-queue): split the request")
    if ids.min() < 0 or ids.max() >= service.vocab:
        raise BadRequest(f"input_ids must be in [0, {service.vocab})")
    if "token_type_ids" in tensors and tensors["token_type_ids"].any():
        raise BadRequest("token_type_ids must be all zeros: this server encodes single-segment inputs")
    mask = tensors.get("attention_mask")
    if mask is None:
        return [row.tolist() for row in ids]
    if ((mask != 0) & (mask != 1)).any():
        raise BadRequest("attention_mask must hold only 0 and 1")
    lengths = mask.sum(axis=1)
    if (lengths == 0).any() or (mask != (np.arange(length) < lengths[:, None])).any():
        raise BadRequest("each attention_mask row must be 1s then 0s (right padding) with at least one 1")
    return [row[:n].tolist() for row, n in zip(ids, lengths)]


async def encoder_infer(service, tensors: dict[str, np.ndarray], wanted: list[tuple[str, bool]]) -> dict:
    from trtserve.runtime.text import WithHidden

    rows = encoder_rows(service, tensors)
    batch, length = tensors["input_ids"].shape
    outputs = [name for name, _ in wanted]
    sizes = {"sentence_embedding": 4 * service.dim * batch, "last_hidden_state": 4 * service.dim * batch * length}
    binary = sum(sizes[name] for name, as_binary in wanted if as_binary)
    as_json = sum(sizes[name] for name, as_binary in wanted if not as_binary)
    if binary > MAX_OUTPUT_BYTES or as_json > MAX_JSON_OUTPUT_BYTES:
        raise BadRequest(f"the requested outputs would be {binary} bytes of binary data and {as_json} bytes as JSON; "
                         f"one answer carries at most {MAX_OUTPUT_BYTES} and {MAX_JSON_OUTPUT_BYTES} (ask for fewer "
                         "rows, only sentence_embedding, or binary data)")
    hidden = "last_hidden_state" in outputs
    results = await service.encode([WithHidden(r) if hidden else r for r in rows])
    answer = {"sentence_embedding": np.stack([r[0] if hidden else r for r in results]).astype(np.float32)}
    if hidden:
        states = np.zeros((batch, length, service.dim), np.float32)  # padded positions stay zero
        for i, (_, state) in enumerate(results):
            states[i, : len(state)] = state
        answer["last_hidden_state"] = states
    return {name: answer[name] for name in outputs}


def _rendered(name: str, request_id: str | None, tensors: dict, wanted: list[tuple[str, bool]]):
    head, blobs = response(name, request_id, tensors, wanted)
    return json.dumps(head, separators=(",", ":")).encode(), blobs


def response(name: str, request_id: str | None, tensors: dict[str, np.ndarray],
             wanted: list[tuple[str, bool]]) -> tuple[dict, list[bytes]]:
    """The answer's JSON and, in the same order, the binary blobs of the outputs sent as binary data."""
    outputs, blobs = [], []
    for output, binary in wanted:
        tensor = np.ascontiguousarray(tensors[output], dtype=tensors[output].dtype.newbyteorder("<"))
        entry: dict[str, object] = {"name": output, "datatype": V2_NAMES[tensor.dtype.name],
                                    "shape": list(tensor.shape)}
        if binary:
            blob = tensor.tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = tensor.reshape(-1).tolist()
        outputs.append(entry)
    head = {"model_name": name, "model_version": VERSION, "outputs": outputs}
    if request_id is not None:
        head["id"] = request_id
    return head, blobs
