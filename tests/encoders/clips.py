"""Real video clips made by PyAV, for the encoder and gateway tests."""

import io

import av
import numpy as np


def make_clip(seconds: float, fps: int = 10, size: int = 64, codec: str = "mpeg4",
              container: str = "mp4") -> bytes:
    """Frame i is solid gray 10 * i (mod 250): a decoded frame names its own index."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(round(seconds * fps)):
            pixels = np.full((size, size, 3), 10 * i % 250, np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()
