"""Trees as data: presets, greedy growth from acceptance tables, compiled masks (``tree``),
and the node budget every tree is cut to (``budget``). Knows nothing of heads or backbones."""
