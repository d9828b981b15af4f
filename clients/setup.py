"""The client distribution, `sluice-client`: sluice_client (SDK + CLI) and the sluice.v1 stubs.

The stubs are generated from ../protos when the wheel is built (grpcio-tools is a build
requirement only), so the wheel never carries stale code and the runtime needs grpcio and
protobuf alone. Build from a checkout (the protos live beside this folder).
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PROTOS = HERE.parent / "protos"
STUBS = "sluice/v1"


class BuildWithStubs(build_py):  # type: ignore[misc]  # setuptools ships no types
    """Generates sluice/v1/*_pb2*.py(i) into the build folder before packaging."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        # This folder is the package itself: its build script is not a module of it.
        return [entry for entry in super().find_package_modules(package, package_dir) if entry[1] != "setup"]

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return   # an editable install imports the checkout's sluice/v1 (`make protos`)
        from grpc_tools import protoc  # build time only

        out = Path(self.build_lib)
        sources = sorted(str(path) for path in (PROTOS / STUBS).glob("*.proto"))
        if not sources:
            raise SystemExit(f"no .proto files under {PROTOS / STUBS}: build sluice-client from a checkout")
        include = Path(protoc.__file__).resolve().parent / "_proto"
        code = protoc.main(["grpc_tools.protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out}",
                            f"--pyi_out={out}", f"--grpc_python_out={out}", *sources])
        if code != 0:
            raise SystemExit(f"protoc failed ({code}) on {sources}")
        # sluice.v1 is a regular package inside the `sluice` namespace, typed through its .pyi files.
        (out / STUBS / "__init__.py").write_text('"""Generated from protos/sluice/v1 at build time."""\n')
        (out / STUBS / "py.typed").write_text("")


setup(cmdclass={"build_py": BuildWithStubs})
