"""The agent demo's tool (examples/tiny_cpu_agent.yaml, `make demo-agent`): one call without arguments
that a tiny model can learn to write, returning the centre of the prompt's image at full resolution.

`row` is the sample's row (its decoded images); the model never sees it as an argument.
"""

from PIL import Image

WINDOW = 56  # px: the side of the centre square, within the demo's pixel budget (56 x 56)


def zoom(row: dict = None) -> Image.Image:
    """Zoom into the centre of the image: its central 56x56 pixels at full resolution."""
    image: Image.Image = row["images"][0]
    left, top = (image.width - WINDOW) // 2, (image.height - WINDOW) // 2
    return image.crop((left, top, left + WINDOW, top + WINDOW))
