"""The cost of grammar-constrained sampling per token (engine/grammar.py, llguidance), beside a decode step.

    python benchmarks/grammar_mask.py --samples 8 --tokens 48

On the default model (SmolLM2-135M, all in RAM) a JSON-schema reply is sampled `--samples` times (seeds 0..n-1,
temperature 1, one at a time); every constrained token's mask (`Constraint.mask`: llguidance's bitmask, unpacked
and applied to the [V] logits) and grammar step (`Constraint.advance`) are timed, beside the whole step of the
engine that produced the token. Reported: mean and p95 mask + advance time per token, the mean step time, and the
mask's share of it. State whether the machine was contended.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"},
                                                               "maxItems": 4}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    import colibri
    from colibri.engine import grammar
    from colibri.engine.sampling import SamplingParams
    m = colibri.load(a.model, threads=a.threads) if a.model else colibri.load(threads=a.threads)
    g = grammar.json_schema_grammar(SCHEMA)
    prompt = m.chat_ids([{"role": "user", "content": "Describe a person as JSON: name, age, city and tags."}])
    mask_s: list[float] = []
    step_s: list[float] = []
    for seed in range(a.samples):
        req = m.engine.add_request(prompt, SamplingParams(max_tokens=a.tokens, temperature=1.0, seed=seed,
                                                          grammar=g))
        c = req.sampler.constraint
        mask, advance = c.mask, c.advance

        def timed(f):
            def run(*args):
                t = time.perf_counter()
                out = f(*args)
                mask_s[-1] += time.perf_counter() - t
                return out
            return run

        c.mask, c.advance = timed(mask), timed(advance)
        while not req.finished:
            mask_s.append(0.0)
            had = len(req.token_ids) + (req.finished)
            t = time.perf_counter()
            m.engine.step()
            step_s.append(time.perf_counter() - t)
            if len(req.token_ids) == had and not req.finished:  # a prefill chunk: no token sampled
                mask_s.pop()
                step_s.pop()
    per = sorted(mask_s)
    out = {"tokens": len(per), "mask_mean_ms": round(1e3 * statistics.mean(per), 3),
           "mask_p95_ms": round(1e3 * per[int(0.95 * (len(per) - 1))], 3),
           "step_mean_ms": round(1e3 * statistics.mean(step_s), 3),
           "mask_share_of_step": round(sum(per) / sum(step_s), 4), "vocab": m.tokenizer.vocab_size}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
