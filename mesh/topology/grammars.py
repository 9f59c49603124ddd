"""The grammars of the values a launcher pastes into what it generates: the ``#SBATCH`` lines of a
Slurm batch script and the fields of Kubernetes objects.

A topology is checked against them when it is read, so a value its target would misread (a
newline that starts a new directive or shell command, a space that adds an sbatch option) or
refuse (a name, label or quantity Kubernetes does not take) stops the check naming its key,
not the job at submission or the objects at ``kubectl apply``. Neither the ``kubernetes``
client nor the OpenAPI schema the rendered objects are validated against checks these (the
schema types names, labels, images and quantities as plain strings), so each grammar is
written out here from its source: Kubernetes' API validation (``k8s.io/apimachinery``), the
image reference of ``github.com/distribution/reference``, and sbatch's manual.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import AfterValidator

SHOWN_CHARS = 80
# the longest string a topology holds (``mesh.topology.schema.MAX_TEXT``): the limit of a grammar with none of its
# own
TEXT_CHARS = 4096


@dataclass(frozen=True)
class Grammar:
    """What a value must look like: in words (``what``, ``rule``, an ``example``) for the message, and
    as a ``pattern`` (matched whole) and a length limit for the check."""

    what: str
    rule: str
    pattern: str
    example: str
    max_chars: int = TEXT_CHARS

    def matches(self, value: str) -> bool:
        # the length first: it bounds the pattern's work on a hostile value
        return len(value) <= self.max_chars and re.fullmatch(self.pattern, value) is not None

    def check(self, value: str) -> str:
        """``value``, or a ``ValueError`` naming the grammar and the fix (the caller's key path comes
        with it: a field's from pydantic, a check's from its own message)."""
        if not self.matches(value):
            raise ValueError(f"{self.refusal(value)}; write it like {self.example!r}")
        return value

    def refusal(self, value: str) -> str:
        """Why ``value`` is refused, for a message that goes on with its own fix."""
        shown = repr(value) if len(value) <= SHOWN_CHARS else f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"
        return f"{shown} is not {self.what} ({self.rule})"

    @property
    def field(self) -> AfterValidator:
        """The check as a pydantic validator: ``Annotated[str, GRAMMAR.field]``."""
        return AfterValidator(self.check)


# --- Slurm: a value of an ``#SBATCH`` line is one word to sbatch, which ends a word at whitespace,
# reads '#' as the start of a comment and '"', "'" and '\' as quoting; a newline ends the directive
# and may start a shell command. None of them, nor a control character, may appear in one.
_SBATCH_WORD = r"[^\s#\"'\\\x00-\x1f\x7f]+"
_SLURM_NAME = r"[A-Za-z0-9][A-Za-z0-9_.+-]*"

SLURM_NAME = Grammar(
    "a Slurm name", "letters, digits, '_', '.', '+' and '-', starting with a letter or digit", _SLURM_NAME, "gpu"
)
SLURM_NAMES = Grammar(
    "a list of Slurm names",
    "names of letters, digits, '_', '.', '+' and '-', separated by ','",
    rf"{_SLURM_NAME}(?:,{_SLURM_NAME})*",
    "gpu",
)
# sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds, or no limit
SLURM_TIME = Grammar(
    "an sbatch time limit",
    "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or UNLIMITED",
    r"[0-9]+(?::[0-9]+){0,2}|[0-9]+-[0-9]+(?::[0-9]+){0,2}|(?i:unlimited|infinite)",
    "1-00:00:00",
)
# sbatch --mem: an integer, in megabytes unless a unit follows
SLURM_MEM = Grammar(
    "an sbatch memory size", "an integer with an optional unit K, M, G or T (megabytes without one)",
    r"[0-9]+[KMGTkmgt]?", "16G"
)  # fmt: skip
SBATCH_OPTION = Grammar(
    "one sbatch long option",
    "'--name' or '--name=value' as sbatch spells it, the value without whitespace, '#', quotes or '\\'",
    rf"--[a-z][a-z0-9-]*(?:={_SBATCH_WORD})?",
    "--constraint=h100",
)
SBATCH_WORD = Grammar(
    "one word of an #SBATCH line", "no whitespace, '#', quotes or '\\'", _SBATCH_WORD, "tiny-trainer"
)
# --output is also a filename pattern, whose '%' sbatch expands
SBATCH_PATH = Grammar(
    "a path sbatch writes to as given",
    "no whitespace, '#', '%', quotes or '\\'",
    r"[^\s#%\"'\\\x00-\x1f\x7f]+",
    "/scratch/runs",
)

# --- Kubernetes (k8s.io/apimachinery/pkg/util/validation): object names, label keys and values
_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = rf"{_LABEL}(?:\.{_LABEL})*"
_LABEL_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"

DNS_LABEL = Grammar(
    "an RFC 1123 label, as Kubernetes names a namespace or a Job",
    "lowercase letters, digits and '-', starting and ending with a letter or digit, at most 63 characters",
    _LABEL,
    "team-a",
    63,
)
DNS_SUBDOMAIN = Grammar(
    "an RFC 1123 subdomain, as Kubernetes names most objects",
    "lowercase letters, digits, '-' and '.', each '.'-separated part starting and ending with a letter or digit, "
    "at most 253 characters",
    _SUBDOMAIN,
    "composer-runs",
    253,
)
LABEL_VALUE = Grammar(
    "a Kubernetes label value",
    "empty, or letters, digits, '-', '_' and '.', starting and ending with a letter or digit, at most 63 characters",
    rf"(?:{_LABEL_NAME})?",
    "team-a",
    63,
)
# a qualified name: an optional DNS subdomain prefix (at most 253 characters) and '/', then a name of at
# most 63 characters; the lookaheads hold those two limits
LABEL_KEY = Grammar(
    "a Kubernetes label key",
    "an optional DNS subdomain prefix and '/', then at most 63 letters, digits, '-', '_' and '.', "
    "starting and ending with a letter or digit",
    rf"(?:(?=[^/]{{1,253}}/){_SUBDOMAIN}/)?(?=[^/]{{1,63}}\Z){_LABEL_NAME}",
    "nvidia.com/gpu.product",
    253 + 1 + 63,
)
# resource.Quantity: a signed decimal number, then a binary (Ki..Ei) or decimal (m, k..E) SI suffix or an
# exponent (e3, E-2)
QUANTITY = Grammar(
    "a Kubernetes quantity",
    "a number, then optionally one of Ki, Mi, Gi, Ti, Pi, Ei, m, k, M, G, T, P, E or an exponent like e9",
    r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[KMGTPE]i|[mkMGTPE]|[eE][+-]?[0-9]+)?",
    "20Gi",
)
# distribution/reference: [host[:port]/]path[:tag][@digest], path components in lowercase; a name of at most
# 255 characters, a tag of at most 128 and a sha512 digest at most 135
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE = Grammar(
    "an image reference",
    "[registry[:port]/]path[:tag][@digest], the path of lowercase letters and digits joined by '/', '.', '_' "
    "or '-', the tag of letters, digits, '_', '.' and '-', no whitespace",
    rf"(?:{_HOST}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?(?:@{_DIGEST})?",
    "registry.example:5000/team/composer-mesh:0.1.0",
    255 + 1 + 128 + 1 + 135,
)


def positive_quantity(value: str) -> str:
    """A quantity greater than zero (what a volume claim's storage request must be)."""
    QUANTITY.check(value)
    number = re.match(r"[+-]?[0-9.]*", value).group()
    if number.startswith("-") or not re.search(r"[1-9]", number):
        raise ValueError(f"{value!r} is not greater than zero, which a volume's size must be; write it like '20Gi'")
    return value
