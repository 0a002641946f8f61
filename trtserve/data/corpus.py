"""Real English text for parity, fidelity and benchmarks: Wikipedia articles shipped in gensim.

Random token ids underestimate fp16 overflow, so every probe defaults to this text.
"""

from __future__ import annotations

import bz2
import re
from functools import lru_cache
from pathlib import Path

from trtserve.errors import TrtServeError

WIKI_FILE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
_MARKUP = re.compile(r"'{2,}")


def wiki_path() -> Path:
    try:
        import gensim
    except ImportError:
        raise TrtServeError(
            "real-text probes use the Wikipedia sample shipped in gensim: pip install gensim==4.4.0"
        ) from None
    return Path(gensim.__file__).parent / WIKI_FILE


@lru_cache(maxsize=1)
def wiki_paragraphs(min_words: int = 20) -> tuple[str, ...]:
    """About 5,000 cleaned paragraphs from about 200 articles, in file order (deterministic)."""
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    paragraphs = []
    with bz2.open(wiki_path(), "rb") as handle:
        for _title, text, _page_id in extract_pages(handle):
            if not text:
                continue
            for line in filter_wiki(text).split("\n"):
                line = _MARKUP.sub("", line).strip()
                if len(line.split()) >= min_words:
                    paragraphs.append(line)
    return tuple(paragraphs)


def wiki_text(n_words: int, start: int = 0) -> str:
    """One long run of consecutive paragraphs holding at least n_words words."""
    out, count = [], 0
    for paragraph in wiki_paragraphs()[start:]:
        out.append(paragraph)
        count += len(paragraph.split())
        if count >= n_words:
            break
    return "\n\n".join(out)
