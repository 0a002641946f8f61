"""Precision policies. fp32 is the identity policy: the exported graph is kept as it is."""

from __future__ import annotations

POLICIES = ("fp32",)


def describe(policy: str) -> dict:
    if policy == "fp32":
        return {"policy": "fp32", "fp32_ops": "all", "fp16_ops": []}
    raise ValueError(f"unknown precision policy {policy!r}; available: {', '.join(POLICIES)}")
