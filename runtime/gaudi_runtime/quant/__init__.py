"""FP8: Intel Neural Compressor on Gaudi (inc.py), our own float8 layers elsewhere (fp8_linear.py, apply.py),
QUANT_CONFIG parsing (config.py), layer selection (layers.py), measurement (measure.py, calibrate.py) in INC's
file layout (stats.py), and the shard's one step after loading (setup.py). See docs/quantization.md."""
