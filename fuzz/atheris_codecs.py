"""Coverage-guided fuzzing of the block decoders with atheris (optional: `pip install atheris`).

    python fuzz/atheris_codecs.py -max_total_time=600 [corpus_dir]

A fuzz input is one block: ``codec · word size · word count (u16) · base seed · payload``.
The base block comes from the seed (BF16-like weights for 2-byte words, so the context codec's
exponent groups are realistic; random bytes otherwise). The payload is given to both ways
apply has of using a block: ``patch_in_place`` (the compiled one-pass loops of codecs 4-7) and
``decode_block``. Each must end in a CorruptPatchError or give a block of the right size, and
when both accept the payload they must give the same bytes. Anything else is a crash.

Seeds: real blocks of every codec, encoded from nudged base blocks (see ``_seeds``). The checks
inside the patch container (checksums, header) are left to fuzz/atheris_patch.py; here every
input reaches the decoders. For memory errors in the C loops, build the extension with
AddressSanitizer and coverage (docs: the comment at the end of this file).
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import atheris
import numpy as np

with atheris.instrument_imports():
    from pulsectl.codecs import (
        CODEC_CONTEXT,
        CODEC_CONTEXT_PAIRED,
        CODEC_NAMES,
        context,
        decode_block,
        encode_block,
        patch_in_place,
    )
    from pulsectl.codecs.context import KEYS
    from pulsectl.codecs.delta import find_changes
    from pulsectl.errors import CorruptPatchError

_WORDS = (1, 2, 4, 8)
_KEY_OF_WORD = {1: KEYS["F8_E4M3"], 2: KEYS["BF16"], 4: KEYS["F32"], 8: KEYS["F64"]}
_HEAD = struct.Struct("<BBHB")  # codec, word size (index), word count, base seed
_MAX_WORDS = 4096


def _base(word: int, nwords: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if word == 2:
        scale = (0.02, 1.0, 1e-4, 30.0)[seed % 4]
        w = rng.normal(0.0, scale, nwords).astype(np.float32).view(np.uint32) >> 16
        return w.astype(np.uint16).view(np.uint8)
    return rng.integers(0, 256, nwords * word, dtype=np.uint8)


def _split(data: bytes) -> tuple[int, int, int, np.ndarray, bytes] | None:
    if len(data) < _HEAD.size:
        return None
    codec, w, nwords, seed = _HEAD.unpack_from(data)
    word = _WORDS[w % len(_WORDS)]
    nwords = 1 + nwords % _MAX_WORDS
    return codec % 8, word, nwords, _base(word, nwords, seed), data[_HEAD.size :]


def test_one_input(data: bytes) -> None:
    split = _split(data)
    if split is None:
        return
    codec, word, nwords, old, payload = split
    size = word * nwords
    whole = None
    try:
        whole = decode_block(codec, payload, old.copy(), size, word)
        assert whole.dtype == np.uint8 and whole.size == size, (whole.dtype, whole.size, size)
    except CorruptPatchError:
        pass
    in_place = old.copy()
    try:
        done = patch_in_place(codec, payload, in_place, word)
    except CorruptPatchError:
        return
    if done and whole is not None:
        assert np.array_equal(in_place, whole), f"codec {codec}: the two decoders disagree"


_SEED_BLOCKS = ((64, 0.05, 1), (1024, 0.01, 2), (2048, 0.3, 3), (777, 1.0, 4), (2048, 0.02, 5))


def _seeds() -> list[bytes]:
    """Real blocks: every word size, sparse to dense changes, default level and context."""
    out = []
    rng = np.random.default_rng(7)
    for w, word in enumerate(_WORDS):
        for nwords, fraction, seed in _SEED_BLOCKS:
            old = _base(word, nwords, seed)
            new = old.copy().view(f"<u{word}")
            count = max(1, int(nwords * fraction))
            picks = rng.choice(nwords, count, replace=False)
            if word == 2 and seed % 2:  # changes where the exponent is small: codec 4 wins
                exponents = (new >> 7) & 0xFF
                small = np.flatnonzero(exponents <= np.quantile(exponents, 0.3))
                picks = rng.choice(small, min(count, small.size), replace=False)
            minus_one = np.iinfo(new.dtype).max  # a move of -1, wrapping
            new[picks] += rng.choice(np.array([1, 1, 2, minus_one], dtype=new.dtype), picks.size)
            new8 = new.view(np.uint8)
            blocks = [
                (b.codec, b.payload)
                for b in (encode_block(old, new8, word, 3), encode_block(old, new8, word, 19))
            ]
            # The context codec too, whether or not it would win here: plain and paired.
            positions = find_changes(old, new8, word)
            for pair in (False, True):
                payload, paired = context.encode(
                    old, new8, word, positions, _KEY_OF_WORD[word], 19, pair=pair
                )
                blocks.append((CODEC_CONTEXT_PAIRED if paired else CODEC_CONTEXT, payload))
            out += [_HEAD.pack(c, w, nwords - 1, seed) + p for c, p in blocks]
    return out


def main() -> None:
    argv = list(sys.argv)
    corpus = [a for a in argv[1:] if not a.startswith("-")]
    if corpus:  # seed an empty corpus folder with real blocks
        folder = Path(corpus[0])
        folder.mkdir(parents=True, exist_ok=True)
        if not any(folder.iterdir()):
            for n, seed in enumerate(_seeds()):
                codec = CODEC_NAMES.get(seed[0], str(seed[0]))
                (folder / f"seed-{n:02d}-{codec}").write_bytes(seed)
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

# With AddressSanitizer and coverage of the C loops (clang; libFuzzer and ASan in one preloaded
# library, as atheris's own native-extension guide builds it):
#
#   CC=clang LDSHARED="clang -shared" CFLAGS="-g -O1 -fsanitize=address \
#     -fsanitize-coverage=inline-8bit-counters,pc-table,trace-cmp" \
#     python setup.py build_ext --inplace --force
#   cp "$(clang -print-file-name=libclang_rt.asan-x86_64.a)" asan.a
#   ar d asan.a asan_preinit.cpp.o
#   clang++ -shared -o asan_with_fuzzer.so -Wl,--whole-archive asan.a \
#     "$(clang -print-file-name=libclang_rt.fuzzer_no_main-x86_64.a)" -Wl,--no-whole-archive \
#     -lpthread -ldl -lrt -lm
#   LD_PRELOAD=$PWD/asan_with_fuzzer.so ASAN_OPTIONS=detect_leaks=0 \
#     python fuzz/atheris_codecs.py -max_total_time=3600 corpus/
