"""A tool file for multi-turn rollouts (worker.rollout.multi_turn.tools=[examples/tools/zoom.py]).

Each public function below is a tool: its type hints and docstring become the schema the model reads.
`row` is the sample's row (decoded images, videos, audios, ground truth, other columns); the model never
sees it as an argument.
"""

from PIL import Image


def zoom(x: float, y: float, size: float = 0.25, row: dict = None) -> list:
    """Look closer at a square region of the image, at full resolution.

    Args:
        x: left edge of the region, as a fraction of the image width (0 to 1)
        y: top edge of the region, as a fraction of the image height (0 to 1)
        size: side of the region, as a fraction of the image's shorter side
    """
    image: Image.Image = row["images"][0]
    side = max(1, int(size * min(image.size)))
    left, top = int(x * image.width), int(y * image.height)
    box = (left, top, min(image.width, left + side), min(image.height, top + side))
    return [f"region {box}", image.crop(box)]
