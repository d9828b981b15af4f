"""The Kubernetes API server over plain HTTPS REST (aiohttp): the four calls the provider makes.

    get_scale     GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale
    patch_scale   PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   (merge patch carrying
                                                                                   the resourceVersion read)
    list_pods     GET   /api/v1/namespaces/{ns}/pods?labelSelector=...
    annotate_pod  PATCH /api/v1/namespaces/{ns}/pods/{name}                     (merge patch of annotations)

Each call is one RBAC rule (CALLS): a 403 names the rule the service account lacks, so the error says
what to add to the Role (deploy/k8s/autoscaler.yaml grants exactly CALLS; tests/test_autoscaler_k8s.py
checks it does). Access is the pod's service account (token, CA, namespace under ACCOUNT_DIR and the
API server from KUBERNETES_SERVICE_HOST/PORT) unless [autoscaler.kubernetes] names them. The token
file is re-read on every request: projected service account tokens rotate (about hourly).
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from sluice.autoscaler.k8s_objects import Pod, Scale, pods_of
from sluice.autoscaler.provider import ProviderError
from sluice.config.settings import KubernetesSection

ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
REQUEST_TIMEOUT_S = 10.0
MERGE_PATCH = "application/merge-patch+json"

ERR_NO_SERVER = ("kubernetes provider: no [autoscaler.kubernetes].api_url and not in a pod "
                 "(KUBERNETES_SERVICE_HOST is unset)")
ERR_NO_FILE = "kubernetes provider: cannot read {what} {path} ({error}); set [autoscaler.kubernetes].{key}"
ERR_FORBIDDEN = ("kubernetes API refused {verb} {resource} {name!r} in namespace {namespace!r} "
                 "(403 Forbidden): "
                 "the autoscaler's service account needs a Role rule apiGroups: [\"{group}\"], "
                 "resources: [\"{resource}\"], verbs: [\"{verb}\"] (deploy/k8s/autoscaler.yaml). "
                 "The API server said: {message}")
ERR_UNAUTHORIZED = ("kubernetes API rejected the token read from {token_file} (401 Unauthorized) on {verb} "
                    "{resource}: the token is not valid for this API server (wrong token_file or api_url, "
                    "or a service account token that expired)")
ERR_STATUS = "kubernetes API answered {status} to {method} {path}: {message}"
ERR_UNREACHABLE = "kubernetes API at {url} unreachable on {method} {path}: {error}"


@dataclass(frozen=True, slots=True)
class Call:
    """One kind of request, as RBAC authorizes it."""

    verb: str                   # RBAC verb
    group: str                  # API group ("" = core)
    resource: str               # resource[/subresource]


GET_SCALE = Call("get", "apps", "deployments/scale")
PATCH_SCALE = Call("patch", "apps", "deployments/scale")
LIST_PODS = Call("list", "", "pods")
PATCH_POD = Call("patch", "", "pods")
CALLS = (GET_SCALE, PATCH_SCALE, LIST_PODS, PATCH_POD)


class KubeError(ProviderError):
    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status                # the HTTP status (0: no answer)


class KubeConflict(KubeError):
    """409: the object changed since its resourceVersion was read; read it again and retry."""


class KubeNotFound(KubeError):
    """404: the object does not exist (a pod already deleted)."""


@dataclass(frozen=True, slots=True)
class KubeAccess:
    api_url: str                # https://host:port, no trailing slash
    token_file: Path
    ca_file: Path | None        # None: the system's trust store
    namespace: str

    @classmethod
    def resolve(cls, section: KubernetesSection, environ: Mapping[str, str] = os.environ,
                account_dir: Path = ACCOUNT_DIR) -> KubeAccess:
        """The explicit settings, each empty one filled from the pod's service account."""
        api_url = section.api_url
        if not api_url:
            host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ProviderError(ERR_NO_SERVER)
            api_url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        token_file = Path(section.token_file) if section.token_file else account_dir / "token"
        ca_file: Path | None = Path(section.ca_file) if section.ca_file else account_dir / "ca.crt"
        if not section.ca_file and ca_file is not None and not ca_file.exists():
            ca_file = None                  # an explicit api_url outside a pod: the system's CAs
        namespace = section.namespace or _read(account_dir / "namespace", "namespace file", "namespace")
        _read(token_file, "token file", "token_file")     # refused now, not at the first tick
        return cls(api_url=api_url.rstrip("/"), token_file=token_file, ca_file=ca_file, namespace=namespace)

    def token(self) -> str:
        return _read(self.token_file, "token file", "token_file")


def _read(path: Path, what: str, key: str) -> str:
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise ProviderError(ERR_NO_FILE.format(what=what, path=path, error=exc.strerror, key=key)) from None


class KubeApi:
    def __init__(self, access: KubeAccess) -> None:
        self.access = access
        self._http: aiohttp.ClientSession | None = None

    # --- the calls ----------------------------------------------------------------------------

    async def get_scale(self, deployment: str) -> Scale:
        return Scale.of(await self._request(GET_SCALE, "GET", self._scale_path(deployment), deployment))

    async def patch_scale(self, deployment: str, replicas: int, resource_version: str) -> Scale:
        """Set spec.replicas unless the scale was written since `resource_version` (then KubeConflict)."""
        body = {"metadata": {"resourceVersion": resource_version}, "spec": {"replicas": replicas}}
        path = self._scale_path(deployment)
        return Scale.of(await self._request(PATCH_SCALE, "PATCH", path, deployment, body))

    async def list_pods(self, selector: str) -> list[Pod]:
        path = f"/api/v1/namespaces/{self.access.namespace}/pods?labelSelector={quote(selector, safe='')}"
        return pods_of(await self._request(LIST_PODS, "GET", path, selector))

    async def annotate_pod(self, name: str, annotations: Mapping[str, str | None]) -> Pod:
        """Merge the annotations into the pod's (a None value removes that key)."""
        path = f"/api/v1/namespaces/{self.access.namespace}/pods/{name}"
        return Pod.of(await self._request(PATCH_POD, "PATCH", path, name,
                                          {"metadata": {"annotations": dict(annotations)}}))

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    # --- one request, its errors mapped once --------------------------------------------------

    def _scale_path(self, deployment: str) -> str:
        return f"/apis/apps/v1/namespaces/{self.access.namespace}/deployments/{deployment}/scale"

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            ca_file = self.access.ca_file
            context = ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
                                               connector=aiohttp.TCPConnector(ssl=context))
        return self._http

    async def _request(self, call: Call, method: str, path: str, name: str,
                       body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.access.token()}", "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = MERGE_PATCH
            data = json.dumps(body)
        try:
            async with self._session().request(method, self.access.api_url + path, headers=headers,
                                               data=data) as response:
                text = await response.text()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubeError(ERR_UNREACHABLE.format(url=self.access.api_url, method=method, path=path,
                                                   error=exc or type(exc).__name__)) from None
        if status < 300:
            answer: dict[str, Any] = json.loads(text)
            return answer
        raise self._error(call, method, path, name, status, text)

    def _error(self, call: Call, method: str, path: str, name: str, status: int, text: str) -> KubeError:
        message = _status_message(text)
        if status == 401:
            return KubeError(ERR_UNAUTHORIZED.format(token_file=self.access.token_file, verb=call.verb,
                                                     resource=call.resource), status)
        if status == 403:
            return KubeError(ERR_FORBIDDEN.format(verb=call.verb, resource=call.resource, name=name,
                                                  namespace=self.access.namespace, group=call.group,
                                                  message=message), status)
        kind = {409: KubeConflict, 404: KubeNotFound}.get(status, KubeError)
        return kind(ERR_STATUS.format(status=status, method=method, path=path, message=message), status)


def _status_message(text: str) -> str:
    """A Status object's message (what the API server says went wrong), else the body as is."""
    try:
        return str(json.loads(text).get("message") or text)
    except (ValueError, AttributeError):
        return text[:500]
