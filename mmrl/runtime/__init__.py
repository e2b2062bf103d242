"""The machine a run runs on, apart from the algorithm: what a run leaves outside its output folder
(vLLM shared memory and sockets, Ray sessions, mmrl's temporary folders) and how it is cleaned
(``debris``), and the start-up of its processes (``startup``). Standard library only, so every layer,
from the rollout engine to the driver, may use it.
"""
