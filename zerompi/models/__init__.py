"""Models written against the public engine API: layer-by-layer forward and backward in xp."""
