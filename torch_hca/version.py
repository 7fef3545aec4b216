"""torch_hca's release: `torch_hca.__version__`, and the version setup.py builds (it reads this
file without importing the package, whose extension is not built yet)."""
__version__ = "0.1.0"
