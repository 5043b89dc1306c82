"""The generated SQuAD data set of `make squad-demo` (data/squad_demo.py), for fine-tuning tests."""
from data.squad_demo import QUESTIONS, squad_json  # noqa: F401 (re-exported)
from data.squad_demo import write_squad_demo as write_tiny_squad  # noqa: F401
