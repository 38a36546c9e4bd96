"""A frontend DSL program that picks the adapter per call: base answer, aLoRA check, base continuation, LoRA restyle.

Start a server with the bundled adapters, for instance on CPU (see the README for the CPU flags):

    python -m sglang.launch_server --model-path "$(python -m sgl_multilora.embedded)" --port 30000 \\
        --multilora-adapter-dir assets/adapters --radix-cache-backend multilora \\
        --device cpu --model-impl transformers --attention-backend torch_native --dtype float32 \\
        --max-total-tokens 8192

then run `python examples/multi_adapter_pipeline.py --url http://127.0.0.1:30000`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import sglang as sgl

from sgl_multilora.patches.frontend import MultiLoRAEndpoint, adapter, gen, invocation_text

ADAPTERS_DIR = Path(__file__).resolve().parents[1] / "assets" / "adapters"


@sgl.function
def pipeline(s, question: str, check: str, check_invocation: str, style: str):
    s += "<|im_start|>user\n" + question + "<|im_end|>\n<|im_start|>assistant\n"
    s += sgl.gen("answer", max_tokens=48)  # base model
    s += "<|im_end|>\n" + check_invocation  # the aLoRA switches on at this text
    with adapter(s, check):  # reuses the KV the base model computed for the whole conversation
        s += sgl.gen("verdict", max_tokens=4)
    s += "<|im_end|>\n<|im_start|>user\nTell me one more fact.<|im_end|>\n<|im_start|>assistant\n"
    s += sgl.gen("more", max_tokens=48)  # base model again
    s += "<|im_end|>\n<|im_start|>user\nSay that again.<|im_end|>\n<|im_start|>assistant\n"
    s += gen("restyled", adapter=style, max_tokens=48)  # one call on a standard LoRA


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--question", default="What is the capital of France?")
    parser.add_argument("--check", default="check_caps", help="an aLoRA the server has loaded")
    parser.add_argument("--check-dir", type=Path, default=None, help="its directory (default: assets/adapters/CHECK)")
    parser.add_argument("--style", default="caps", help="a standard LoRA the server has loaded")
    args = parser.parse_args()

    endpoint = MultiLoRAEndpoint(args.url)
    check_invocation = invocation_text(endpoint, args.check_dir or ADAPTERS_DIR / args.check)
    state = pipeline.run(
        question=args.question, check=args.check, check_invocation=check_invocation, style=args.style,
        backend=endpoint, temperature=0,
    )
    for name, on in [("answer", "base"), ("verdict", args.check), ("more", "base"), ("restyled", args.style)]:
        meta = state.get_meta_info(name)
        print(f"{name:>9} [{on}, {meta['cached_tokens']}/{meta['prompt_tokens']} prompt tokens cached]: "
              f"{state[name].strip()!r}")


if __name__ == "__main__":
    main()
