"""Decode speed predicted without loading (`colibri plan`) and measured from a cold start (`colibri bench`).

* `predict`: the prediction model: bytes read per decode token from the placement, the I/O and compute bounds,
  and a replay of one decode pass the way the streaming store overlaps reads and compute;
* `probes`: what the model needs measured: the disk's O_DIRECT bandwidth on the model's own data file, and the
  seconds of compute per token on random weights of the container's own kinds and shapes;
* `runner`: `colibri plan` and `colibri bench` (layout + probes + prediction; a cold-start run beside it),
  returning the `Plan` and `BenchReport` dataclasses, and their text renderings.
"""
