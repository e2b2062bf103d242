"""The agent demo's tool (examples/tiny_cpu_agent.yaml, `make demo-agent`): one call without arguments
that a tiny model can learn to write, returning what lies at the centre of the prompt's image at full
resolution, enlarged so that it fills the processor's pixel budget.

`row` is the sample's row (its decoded images); the model never sees it as an argument.
"""

import numpy as np
from PIL import Image

WINDOW = 7  # px: the side of the centre square searched
SIDE = 56  # px: the returned image, the demo's whole pixel budget (56 x 56)


def zoom(row: dict = None) -> Image.Image:
    """Zoom into the centre of the image: the object in its central 7x7 pixels, enlarged to 56x56."""
    image: Image.Image = row["images"][0]
    left, top = (image.width - WINDOW) // 2, (image.height - WINDOW) // 2
    crop = image.crop((left, top, left + WINDOW, top + WINDOW)).convert("RGB")
    pixels = np.asarray(crop)
    rows, columns = np.nonzero((pixels != 255).any(axis=-1))  # what is not white background
    if len(rows):  # the object's bounding box, so that it fills the view
        crop = crop.crop((columns.min(), rows.min(), columns.max() + 1, rows.max() + 1))
    return crop.resize((SIDE, SIDE), Image.NEAREST)
