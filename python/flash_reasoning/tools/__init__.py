"""Tools around the library: the ``flash-reasoning`` command (``cli``: bench, demo, info,
plot), the benchmark (``bench``, ``report``, ``timing``), the tuner (``tune``), the demo, and
the fixtures they share (``synthetic`` problems, ``trees``: requested tree shapes). The library
(``flash_reasoning``) never imports this package."""
