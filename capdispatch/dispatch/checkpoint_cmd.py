"""`dispatch checkpoint`: a random-weight DeepSeek-V4 checkpoint, cut to N layers at the model's
full width, that SGLang loads as DeepseekV4ForCausalLM (for rehearsing the engine on the
card before the real weights are there). Exit codes: 0 written; 2 bad input (unknown
model, a config without a field the checkpoint needs, --layers out of range, an existing
non-empty --out, a file-system error)."""
from __future__ import annotations

import json
import shlex
import sys

from .errors import ExitCode

EPILOG = """\
examples:
  dispatch checkpoint --model deepseek-v4-flash --layers 4 --out ./v4-flash-4l
      four decoder layers and the next-n layer at full width (about 18.6 GiB)
  dispatch checkpoint --model ./DeepSeek-V4-Flash/config.json --layers 2 --out ./ckpt --seed 7
  dispatch checkpoint --model deepseek-v4-flash --layers 2 --out ./ckpt --format json

then: python -m sglang.launch_server --model-path ./ckpt --skip-tokenizer-init --tp 1
      (no tokenizer is written: requests carry input_ids)
exit codes: 0 written; 2 bad input (unknown model, a config.json without a field the
checkpoint needs, --layers out of range, --out not new or empty, a file-system error).
"""

PORT = 30000
REQUEST = {"input_ids": [10, 11, 12, 13], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}


def add_parser(sub):
    from .options import add, whole
    p = sub.add_parser("checkpoint", help="write a random-weight DeepSeek-V4 checkpoint SGLang loads",
                       description="Write a Hugging Face folder SGLang loads as DeepseekV4ForCausalLM: "
                                   "the model's config.json cut to N decoder layers (its next-n layer "
                                   "kept), and safetensors shards with the real checkpoint's tensor "
                                   "names, stored formats and shapes at the model's full width, "
                                   "holding random values scaled for finite, well-conditioned "
                                   "activations. No tokenizer: serve it with --skip-tokenizer-init.",
                       epilog=EPILOG)
    add(p, "model", required=True)
    p.add_argument("--layers", required=True, metavar="N", type=lambda v: whole(1)("--layers", v),
                   help="decoder layers to write, 1 to the model's num_hidden_layers")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the folder to create (new, or empty); nothing is left there on failure")
    p.add_argument("--seed", default=0, metavar="S", type=lambda v: whole(0)("--seed", v),
                   help="the values' seed: the same seed writes the same bytes (default 0)")
    add(p, "format")
    return p


def serve_hint(written) -> dict:
    notes = ["no tokenizer is written: start SGLang with --skip-tokenizer-init and send input_ids "
             "(token ids below the vocabulary size); the reply carries output_ids",
             "random weights may emit the EOS token (id 1): ask with ignore_eos"]
    if written.mtp and written.layers == 1:
        notes.append("do not load the next-n (MTP) draft on a 1-layer checkpoint (no "
                     "--speculative-algorithm): SGLang's next-n loader then reads decoder layer 0 "
                     "instead of mtp.0; write --layers 2 or more to serve with MTP")
    return {"command": f"python -m sglang.launch_server --model-path {shlex.quote(written.path)} "
                       f"--skip-tokenizer-init --tp 1",
            "request": f"curl -s localhost:{PORT}/generate -d '{json.dumps(REQUEST)}'",
            "notes": notes}


def _progress():
    if not sys.stderr.isatty():
        return None

    def say(done, total, shard):
        end = "\n" if done == total else ""
        print(f"\rwrote {done}/{total} shards ({shard.what})\033[K", end=end, file=sys.stderr,
              flush=True)
    return say


def run(args) -> int:

    from ..models import ModelError, load_model
    from ..models.checkpoint import plan, source_config, write
    shape = load_model(args.model)
    if not 1 <= args.layers <= shape.layers:
        raise ModelError(f"--layers {args.layers}: expected 1 to {shape.layers} (the decoder "
                         f"layers of {shape.name})")
    cfg, where = source_config(args.model)
    p = plan(shape, cfg, where, args.layers)
    from .inputs import needs_torch
    needs_torch("dispatch checkpoint writes random weights")    # the line every command says
    w = write(p, args.out, seed=args.seed, progress=_progress())
    hint = serve_hint(w)
    if args.format == "json":
        print(json.dumps({"schema": 1, "path": w.path, "model": w.model, "layers": w.layers,
                          "mtp_layers": w.mtp, "seed": w.seed, "shards": w.shards,
                          "tensors": w.tensors, "bytes": w.bytes, "seconds": w.seconds,
                          "serve": hint}, indent=2))
    else:
        mtp = f" + {w.mtp} next-n layer" if w.mtp else ""
        lines = [f"wrote {w.path}: {w.model}, {w.layers} decoder layer{'s' if w.layers > 1 else ''}"
                 f"{mtp}; {w.shards} shards, {w.tensors} tensors, {w.bytes / 2 ** 30:.2f} GiB "
                 f"({w.bytes} bytes) in {w.seconds:.1f} s (seed {w.seed})",
                 "serve it with SGLang:", f"  {hint['command']}", f"  {hint['request']}"]
        lines += [f"note: {n}" for n in hint["notes"]]
        print("\n".join(lines))
    return ExitCode.OK
