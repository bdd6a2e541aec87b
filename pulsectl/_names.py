"""Constants the CLI needs at start-up, kept free of heavy imports (numpy, zstandard)."""

DEFAULT_LEVEL = 3  # zstd level of the codec planes
MAX_LEVEL = 22
MAX_PRESET_LEVEL = 19  # `--level max`: the context codec, its tables at this zstd level
CAST_TARGETS = ("bf16", "f16", "f8_e4m3", "f8_e5m2")  # keys of pulsectl.cast.TARGETS
DEFAULT_KS = (1, 2, 4, 8)  # pulsectl.stats.DEFAULT_KS
DEFAULT_ANCHOR_EVERY = 10  # pulsectl.store.publish
DEFAULT_MAX_PATCH_FRACTION = 0.5  # pulsectl.store.publish
CACHE_ENV = "PULSECTL_CACHE_DIR"  # pulsectl.store.publish
DEFAULT_PREFETCH = 2  # pulsectl.store.pull: objects fetched ahead of the patch being applied
