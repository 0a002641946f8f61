"""Smallest schema-valid manifest sections, for tests that write or read an engine directory by hand."""

ARCHITECTURE = {"num_layers": 1, "hidden_size": 8, "num_heads": 2, "num_kv_heads": 2, "head_dim": 4, "vocab_size": 16,
                "max_positions": 32}
MODEL = {"id": "m", "kind": "encoder", "source": "m", "architecture": ARCHITECTURE}
FIDELITY = {"passed": True, "failures": [], "lengths": [], "text": "t", "target": {}}
