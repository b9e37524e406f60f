"""The package list only (everything else is in pyproject.toml): ``packages.find`` there cannot
add ``pitgen.templates``, whose files live in the top-level ``templates/`` folder, and an
explicit list would break the build whenever a listed subpackage is absent."""
from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["pitgen", "pitgen.*"]), "pitgen.templates"])
