"""How a model is served outside the project: its formats and how each loads (formats), writing and checking
ONNX and safetensors (exporter), image files read as a viewer shows them (images)."""
