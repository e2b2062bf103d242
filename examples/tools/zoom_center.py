"""The agent demo's tool (examples/tiny_cpu_agent.yaml, `make demo-agent`): one call without arguments
that a tiny model can learn to write, returning the centre of the prompt's image at full resolution,
enlarged so that the processor's pixel budget keeps every pixel.

`row` is the sample's row (its decoded images); the model never sees it as an argument.
"""

from PIL import Image

WINDOW = 7  # px: the side of the centre square
ENLARGE = 8  # 7 px -> 56 px: the demo's whole pixel budget (56 x 56), each pixel an 8 x 8 block


def zoom(row: dict = None) -> Image.Image:
    """Zoom into the centre of the image: its central 7x7 pixels, enlarged 8 times."""
    image: Image.Image = row["images"][0]
    left, top = (image.width - WINDOW) // 2, (image.height - WINDOW) // 2
    crop = image.crop((left, top, left + WINDOW, top + WINDOW))
    return crop.resize((WINDOW * ENLARGE, WINDOW * ENLARGE), Image.NEAREST)
