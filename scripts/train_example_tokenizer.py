"""Train `tokenizer.model.example`: a small SentencePiece model with LLaMA-2's settings.

The training text is the docstrings of Python's own standard library (PSF-licensed, on every machine
that runs this project), so the model can be rebuilt anywhere and shipped freely. It is for tests and
demos only: real LLaMA-2 checkpoints come with their own 32,000-piece tokenizer.

    python scripts/train_example_tokenizer.py [--output tokenizer.model.example] [--vocab-size 4000]
"""

import ast
import io
import os
import sysconfig
import tempfile
from pathlib import Path

import fire
import sentencepiece as spm


def stdlib_docstrings():
    """Every docstring of the standard library's pure-Python modules, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if any(part in ("site-packages", "test", "tests", "idlelib", "lib2to3") for part in path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc


def main(output: str = "tokenizer.model.example", vocab_size: int = 4000):
    lines = [line for doc in stdlib_docstrings() for line in doc.splitlines() if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(lines), encoding="utf-8")
        model = io.BytesIO()
        # LLaMA-2's own trainer settings, as recorded in its tokenizer.model, at a smaller vocabulary.
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_writer=model, vocab_size=vocab_size, model_type="bpe",
            character_coverage=0.99995, byte_fallback=True, split_digits=True, split_by_unicode_script=True,
            split_by_whitespace=True, split_by_number=True, max_sentencepiece_length=16,
            add_dummy_prefix=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
            allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            num_threads=1, minloglevel=2,
        )
    tmp_out = f"{output}.tmp"
    Path(tmp_out).write_bytes(model.getvalue())
    os.replace(tmp_out, output)
    print(f"wrote {output}: {vocab_size} pieces from {len(lines)} lines of docstrings")


if __name__ == "__main__":
    fire.Fire(main)
