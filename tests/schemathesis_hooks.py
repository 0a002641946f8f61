"""Schemathesis hooks for the generation routes (SCHEMATHESIS_HOOKS=tests.schemathesis_hooks): a
valid token budget above 8 becomes 8, so that hundreds of generated requests finish in minutes.
Out-of-range budgets (negative, over the context, huge) are sent as generated."""

import schemathesis

CONTEXT = 2048


@schemathesis.hook
def map_body(ctx, body):
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and 8 < value <= CONTEXT:
                body[key] = 8
        if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 8  # chat's default budget is the rest of the context
    return body
