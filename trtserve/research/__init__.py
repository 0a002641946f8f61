"""Research code kept beside the product, never imported by it: the parallel-track training recipe
(`trtserve train-pt`) and the torch shards that compare parallel tracks with tensor parallelism
(`benchmarks/decode/bench_tracks.py`). What serving runs lives in runtime/ and server/."""
