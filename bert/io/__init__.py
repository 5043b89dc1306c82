"""Weights in and out: where a run's starting weights come from (sources.py: a checkpoint of
this project or a HuggingFace directory, hf.py), the ONNX export (export.py), the export to
transformers (hf_export.py), and serving the labelled tasks from an export (serve.py)."""
