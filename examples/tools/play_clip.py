"""The video-tool demo's tool (examples/tiny_cpu_agent_video.yaml, `make demo-agent-video`): one call
without arguments that plays the sample's clip and returns it as video frames. The prompt shows only a
still of the clip (the light off), so the flashes are counted in what this tool returns or not at all.

`row` is the sample's row: its `clip` column holds the clip, an mp4 file as base64 text (python -m
mmrl.demo.synthetic --task clip_flashes); the model never sees it as an argument. The clip travels in
the row because a tool runs in a rollout worker, where the data file's folder is not known.
"""

import base64
import io

import av
import numpy as np

from mmrl.agent.tools import VideoFrames


def play(row: dict = None) -> VideoFrames:
    """Play the clip: its frames, 2 per second."""
    with av.open(io.BytesIO(base64.b64decode(row["clip"]))) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]  # [H, W, 3] each
        fps = float(stream.average_rate)
    return VideoFrames(np.stack(frames), fps=fps)
