"""What the tests and the benchmarks share, importable as trtserve is: the real server on a free port (`server`),
tiny random checkpoints of every decoder family (`tiny_checkpoints`) and checkpoints at the sizes people serve
(`real_checkpoints`). Nothing here is imported by the engine builder or the server."""
