"""What only the demos, tests and benchmarks use; a user's training job never imports it.

- ``tiny``: tiny random Qwen models with a locally trained tokenizer and processor.
- ``synthetic``: image, video and audio tasks a tiny model can learn by RL, written as datasets.
- ``warmup``: the answer-format warm-up that lets RL on a random tiny model start from chance.
- ``ranks``: run a function on N local gloo ranks (forked processes), for the distributed tests and
  benchmarks that need real collectives without Ray.

``tiny``, ``synthetic`` and ``warmup`` are also CLIs (``python -m mmrl.demo.tiny|synthetic|warmup``), as the Makefile's asset targets
call them. The package may import any part of mmrl; nothing in the library imports it.
"""
