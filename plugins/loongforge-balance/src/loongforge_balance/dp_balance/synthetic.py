"""Fixed-seed sample-length mixes of vision-language training data, to test and benchmark the balancer.

The ranges follow common VLM recipes: chat text of 100-2k tokens; an image adds 256-1024 vision tokens to a
50-500 token prompt and answer; a video is 4k-16k tokens (frames x vision tokens per frame, plus text).
"""

from __future__ import annotations

import numpy as np

#: name -> fractions of (text, image, video) samples.
MIXES: dict[str, tuple[float, float, float]] = {
    "text": (1.0, 0.0, 0.0),
    "image": (0.3, 0.7, 0.0),
    "video": (0.4, 0.4, 0.2),
    "vlm": (0.6, 0.3, 0.1),
}


def vlm_lengths(num_samples: int, mix: str = "vlm", seed: int = 0) -> np.ndarray:
    """Token counts (text + vision) of ``num_samples`` shuffled samples drawn from the named mix."""
    if mix not in MIXES:
        raise ValueError(f"unknown mix '{mix}'; known: {', '.join(MIXES)}")
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, size=num_samples, p=MIXES[mix])
    text = rng.integers(100, 2001, size=num_samples)
    image = rng.integers(256, 1025, size=num_samples) + rng.integers(50, 501, size=num_samples)
    video = rng.integers(4000, 16001, size=num_samples)
    return np.choose(kind, [text, image, video]).astype(np.int64)
