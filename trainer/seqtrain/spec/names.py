"""Names of the Kubernetes objects a job creates, and the rules they must follow (torch-free, no I/O).

The operator builds every name with these functions, and spec validation checks that each name a job will ever
generate is valid, so a job that validates can always start: the apiserver would otherwise refuse the object with
a 422 after the status already said GangCreated.

- Service `<job>`: a DNS-1035 label (kube-apiserver's ValidateServiceName): lowercase letters, digits and '-',
  starting with a LETTER, at most 63 characters. This is why `7b-llama` is not a valid job name.
- Pod hostname `<job>-<replica>` (the rendezvous DNS name `<job>-<replica>.<job>`): a DNS-1123 label, <= 63.
- Pod `<job>-<attempt>-<replica>`, ConfigMap `<job>-config-<attempt>`, PodGroup `<job>-<attempt>`: DNS-1123
  subdomains (<= 253 characters), and `<job>` is also the value of the seqtrain.dev/job label (<= 63).
"""

from __future__ import annotations

import re

MAX_JOB_NAME = 50  # room for "-<replica>" in the hostname and "-config-<attempt>" in a label-sized name
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def service_name(job: str) -> str:
    return job


def configmap_name(job: str, attempt: int) -> str:
    return f"{job}-config-{attempt}"


def pod_name(job: str, attempt: int, replica: int) -> str:
    # The attempt is in the name so a new gang never waits for the old pods' names to be released.
    return f"{job}-{attempt}-{replica}"


def hostname(job: str, replica: int) -> str:
    # Stable across attempts: <job>-<replica>.<job> is the DNS name peers use.
    return f"{job}-{replica}"


def podgroup_name(job: str, attempt: int) -> str:
    return f"{job}-{attempt}"


def name_problems(job: str, replicas: int, attempt: int = 10**6) -> list[str]:
    """What is wrong with the names job `job` would generate (empty: every name is valid). `attempt`: the largest
    attempt number checked (a million restarts)."""
    fix = "use lowercase letters, digits and '-', start with a letter, end with a letter or digit"
    if len(job) > MAX_JOB_NAME:
        return [f"{job!r} is {len(job)} characters; at most {MAX_JOB_NAME} (the operator appends suffixes to it)"]
    if not DNS1035_LABEL.match(job):
        hint = f" (e.g. {'job-' + job!r})" if job[:1].isdigit() and DNS1123_LABEL.match(job) else ""
        return [f"{job!r} cannot name the job's Service: it must be a DNS-1035 label; {fix}{hint}"]
    out = []
    host = hostname(job, max(0, replicas - 1))
    if len(host) > 63 or not DNS1123_LABEL.match(host):
        out.append(f"pod hostname {host!r} would not be a DNS-1123 label of at most 63 characters")
    for kind, name in (("pod", pod_name(job, attempt, replicas - 1)), ("ConfigMap", configmap_name(job, attempt)),
                       ("PodGroup", podgroup_name(job, attempt))):
        if len(name) > 253 or not DNS1123_SUBDOMAIN.match(name):
            out.append(f"{kind} name {name!r} would not be a valid DNS-1123 subdomain")
    return out


# ---- Kubernetes' own rules for what a job adds to its pods (apimachinery's validation, checked before anything is
# created: the apiserver would refuse the pod after the status already said GangCreated) -----------------------------
MAX_LABEL = 63
MAX_SUBDOMAIN = 253
MAX_ANNOTATIONS_BYTES = 256 * 1024  # kube-apiserver's TotalAnnotationSizeLimitB: keys and values of one object
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_ENV_VAR_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


def qualified_name_problem(key: object) -> str | None:
    """A label or annotation key: `[prefix/]name`, prefix a DNS-1123 subdomain, name at most 63 characters of
    letters, digits, '-', '_', '.', starting and ending with a letter or digit."""
    if not isinstance(key, str):
        return f"{_show(key)} is not a string"
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > MAX_SUBDOMAIN or not DNS1123_SUBDOMAIN.match(prefix)):
        return (f"{_show(key)}: the prefix before '/' must be a DNS-1123 subdomain of at most {MAX_SUBDOMAIN} "
                "characters (lowercase letters, digits, '-', '.')")
    if len(name) > MAX_LABEL or not _QUALIFIED_NAME.match(name):
        return (f"{_show(key)}: the name must be at most {MAX_LABEL} characters of letters, digits, '-', '_', '.', "
                "starting and ending with a letter or digit")
    return None


def label_value_problem(value: object) -> str | None:
    if not isinstance(value, str):
        return f"{_show(value)} is not a string (quote it)"
    if value and (len(value) > MAX_LABEL or not _QUALIFIED_NAME.match(value)):
        return (f"{_show(value)} must be empty or at most {MAX_LABEL} characters of letters, digits, '-', '_', '.', "
                "starting and ending with a letter or digit")
    return None


def annotations_size(annotations: dict[str, str]) -> int:
    return sum(len(str(k).encode("utf-8", "surrogatepass")) + len(str(v).encode("utf-8", "surrogatepass"))
               for k, v in annotations.items())


def dns1123_label_problem(name: object) -> str | None:
    """Container, volume and port names."""
    if not isinstance(name, str) or len(name) > MAX_LABEL or not DNS1123_LABEL.match(name):
        return (f"{_show(name)} must be a DNS-1123 label: at most {MAX_LABEL} lowercase letters, digits and '-', "
                "starting and ending with a letter or digit")
    return None


def env_var_name_problem(name: object) -> str | None:
    if not isinstance(name, str) or not _ENV_VAR_NAME.match(name):
        return (f"{_show(name)} is not a valid environment variable name (letters, digits, '-', '_', '.', not "
                "starting with a digit)")
    return None
