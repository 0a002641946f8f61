"""Real text the builder, precision search, eval and benchmarks share: Wikipedia paragraphs and labelled
movie-review sentences shipped in gensim. Imports no other package of trtserve but errors and fileio."""
