"""The gateway's SGLang page keys against SGLang 0.5.23's own native page hash.

SGLang's `hicache_hash_cpp.get_hash` (built by scripts/install-sglang.sh from
its wheel's hash_binding.cpp) runs in the install's interpreter; its digests
must equal directory.hashing.sglang_page_digests for the same tokens, or a
gateway in front of SGLang would never find a prefix.
"""

from __future__ import annotations

import json
import random
import subprocess

import pytest

from kvdir.core.hashing import sglang_page_digests
from tests.events.test_sglang_real import sglang_home

_PROBE = """
import json, sys
from array import array
sys.path.insert(0, sys.argv[1])
import hicache_hash_cpp
for tokens, page in json.loads(sys.stdin.read()):
    raw = array("q", tokens)
    print(json.dumps(hicache_hash_cpp.get_hash(raw, len(tokens), 1, False, None, page)))
"""


@pytest.mark.timeout(60)
def test_page_digests_match_sglang_native_hash() -> None:
    home = sglang_home()
    rng = random.Random(7)
    cases = [
        ([rng.randrange(0, 2**32) for _ in range(n)], page)
        for n, page in ((64, 16), (33, 4), (7, 1), (1000, 32))
    ]
    out = subprocess.run(
        [str(home / "bin" / "python"), "-c", _PROBE, str(home / "ext")],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    )
    native = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(native) == len(cases)
    for (tokens, page), theirs in zip(cases, native, strict=True):
        ours = [d.hex() for d in sglang_page_digests(tokens, page)]
        # get_hash also digests a trailing partial page; the radix cache stores (and
        # publishes) whole pages only, so only those are keys.
        full = len(tokens) // page
        assert len(ours) == full and ours == theirs[:full]
