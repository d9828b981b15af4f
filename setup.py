"""The platform distribution, `sluice`: one import root with the design card's folders mapped in.

Only the package list lives here (pyproject.toml holds everything static): subpackages are found
on disk so that a new one needs no edit, and the mapped folders keep their place in the checkout.
"""

from setuptools import find_packages, setup

# Folders that stay at the repository root (the design card's layout) but import as sluice.<name>.
MAPPED_FOLDERS = {"sluice.services": "services", "sluice.ledger": "ledger", "sluice.migrations": "migrations"}


def platform_packages() -> list[str]:
    # sluice.v1 (generated stubs) belongs to the sluice-client distribution.
    packages = find_packages(include=["sluice", "sluice.*"], exclude=["sluice.v1", "sluice.v1.*"])
    for name, folder in MAPPED_FOLDERS.items():
        packages += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]
    return packages


setup(packages=platform_packages(), package_dir={"sluice": "sluice", **MAPPED_FOLDERS})
