"""Download public multi-label datasets into the cache, verify them, convert to XC format.

Registered: Mulan's Bibtex and Delicious (ARFF + XML label header), pinned to
commit 43f6389 of github.com/tsoumakas/mulan; the sha256 values are those of
the uncompressed files recorded in `shared/data/*/SOURCE.txt`. The download
is converted with `mulan_to_xc`, which reproduces the bundled
`<name>_{train,test}.txt` files byte for byte.

The Extreme Classification Repository serves its files from Google Drive
links without stable addresses or published checksums, so none are
registered; add one with `register_dataset(RemoteDataset(...))` once a
stable URL and sha256 are known.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import tempfile
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from array import array
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from snm_jax.errors import DataFormatError, SnmJaxError
from snm_jax.data import datasets, xc_format

MULAN_COMMIT = "43f6389095ad71984264db4387a8074b22bc7d4a"
MULAN_BASE_URL = (
    f"https://raw.githubusercontent.com/tsoumakas/mulan/{MULAN_COMMIT}/data/multi-label")


class DownloadError(SnmJaxError, OSError):
  """A dataset file could not be fetched (offline, HTTP error, ...). Names the URL."""


class ChecksumError(DownloadError):
  """A downloaded file's sha256 differs from the registry's."""


@dataclasses.dataclass(frozen=True)
class RemoteFile:
  """One file to fetch: `<base_url>/<path>`, checked against `sha256`."""
  path: str
  sha256: str


@dataclasses.dataclass(frozen=True)
class RemoteDataset:
  """A downloadable dataset.

  Attributes:
    name: dataset name (cache folder name).
    base_url: URL prefix of every file.
    kind: "mulan" (files: train ARFF, test ARFF, label XML, in that order) or
      "xc" (files: `<name>_train.txt`, `<name>_test.txt`, used as they are).
    files: the files to fetch.
    citation: what to cite.
  """
  name: str
  base_url: str
  kind: str
  files: tuple[RemoteFile, ...]
  citation: str = ""


REGISTRY: dict[str, RemoteDataset] = {}


def register_dataset(spec: RemoteDataset) -> None:
  if spec.kind not in ("mulan", "xc"):
    raise ValueError(f"unknown kind {spec.kind!r}")
  REGISTRY[spec.name] = spec


register_dataset(RemoteDataset(
    name="bibtex", base_url=MULAN_BASE_URL, kind="mulan",
    files=(
        RemoteFile("bibtex/bibtex-train.arff",
                   "8dcc9de6e0b2cebaec8c1f4fac78431adeeb73cfd3ab879b530a66d366e59174"),
        RemoteFile("bibtex/bibtex-test.arff",
                   "9b03329cde64d3f994bdf7fbbac3f3b10fe185c311cb9ae725475f59c7f3f922"),
        RemoteFile("bibtex/bibtex.xml",
                   "08fe20013c1e75dcf1888c185f5187c95e76495b8518ce289b4d3afce38d1232"),
    ),
    citation="I. Katakis, G. Tsoumakas, I. Vlahavas. Multilabel Text Classification for "
             "Automated Tag Suggestion. ECML/PKDD 2008 Discovery Challenge."))
register_dataset(RemoteDataset(
    name="delicious", base_url=MULAN_BASE_URL, kind="mulan",
    files=(
        RemoteFile("delicious/delicious-train.arff",
                   "030186cdb542ebdd32052fcdbb1ebe30115b3a22518c1b4b198c45eb827aebe1"),
        RemoteFile("delicious/delicious-test.arff",
                   "2dfb01723a819914b0ca83361177ed413ce3f2169851d9f228d4692915d63944"),
        RemoteFile("delicious/delicious.xml",
                   "4e0c0f93c7d86a39b9fca4aaefaa00e9428f2c80277732dfbf03ca48e2c14da2"),
    ),
    citation="G. Tsoumakas, I. Katakis, I. Vlahavas. Effective and Efficient Multilabel "
             "Classification in Domains with Large Number of Labels. ECML/PKDD 2008 "
             "Workshop on Mining Multidimensional Data."))


def sha256_of(path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _fetch(url: str, dest: Path, sha256: str, timeout: float) -> None:
  """Downloads `url` to `dest` atomically; raises DownloadError/ChecksumError."""
  dest.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name, suffix=".part")
  try:
    with os.fdopen(fd, "wb") as out:
      try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
          shutil.copyfileobj(resp, out, 1 << 20)
      except urllib.error.HTTPError as e:
        raise DownloadError(f"HTTP {e.code} fetching {url}") from e
      except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise DownloadError(
            f"could not fetch {url} ({reason}); are you offline? Put the files in "
            f"{dest.parent} by hand or set SNM_JAX_DATA_DIR") from e
    got = sha256_of(tmp)
    if got != sha256:
      raise ChecksumError(f"sha256 mismatch for {url}: expected {sha256}, got {got}")
    os.replace(tmp, dest)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def download_dataset(name, cache_dir=None, base_url: str | None = None,
                     timeout: float = 60.0, force: bool = False) -> Path:
  """Fetches a registered dataset into `<cache_dir>/<name>/` in XC text format.

  Args:
    name: a registry name ("bibtex", "delicious") or a `RemoteDataset`.
    cache_dir: destination root (default `datasets.cache_dir()`).
    base_url: overrides the registry's URL prefix (mirrors, tests).
    timeout: socket timeout in seconds.
    force: re-download even if verified files are present.

  Returns:
    The dataset folder, containing `<name>_train.txt`, `<name>_test.txt`
    (and `<name>_labels.txt` for Mulan data); raw downloads are kept in `raw/`.

  Raises:
    KeyError: unknown name. DownloadError: network failure (message names the
    URL). ChecksumError: corrupted or changed file (nothing is kept).
  """
  spec = name if isinstance(name, RemoteDataset) else REGISTRY.get(name)
  if spec is None:
    raise KeyError(f"no download registered for {name!r}; known: {sorted(REGISTRY)}")
  root = Path(cache_dir) if cache_dir is not None else datasets.cache_dir()
  folder = root / spec.name
  base = (base_url or spec.base_url).rstrip("/")
  raw = folder / "raw" if spec.kind == "mulan" else folder
  local = []
  for f in spec.files:
    dest = raw / Path(f.path).name
    if force or not dest.is_file() or sha256_of(dest) != f.sha256:
      _fetch(f"{base}/{f.path}", dest, f.sha256, timeout)
    local.append(dest)
  if spec.kind == "mulan":
    train_arff, test_arff, xml = local
    for split, arff in (("train", train_arff), ("test", test_arff)):
      out = folder / f"{spec.name}_{split}.txt"
      if force or not out.is_file():
        mulan_to_xc(arff, xml, out)
    names = read_mulan_label_names(xml)
    (folder / f"{spec.name}_labels.txt").write_text("\n".join(names) + "\n", encoding="utf-8")
  return folder


# ------------------------------------------------------------------- ARFF -> XC

_ATTR_RE = re.compile(r"@attribute\s+('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\S+)\s+(.+)$",
                      re.IGNORECASE)


def read_mulan_label_names(xml_path) -> list[str]:
  """Label names from a Mulan XML header, in document order."""
  try:
    tree = ET.parse(xml_path)
  except ET.ParseError as e:
    raise DataFormatError(xml_path, e.position[0], f"malformed XML ({e})") from e
  names = [el.get("name") for el in tree.iter() if el.tag.split("}")[-1] == "label"]
  if not names or any(n is None for n in names):
    raise DataFormatError(xml_path, None, "no <label name=...> elements")
  return names


def _unquote(name: str) -> str:
  if len(name) >= 2 and name[0] == name[-1] and name[0] in "'\"":
    return re.sub(r"\\(.)", r"\1", name[1:-1])
  return name


def read_mulan_arff(arff_path, xml_path) -> tuple[sp.csr_matrix, sp.csr_matrix, list[str]]:
  """Reads a Mulan multi-label ARFF file (sparse or dense rows).

  Label id k is the k-th ARFF attribute whose name is in the XML header;
  feature id j is the j-th other attribute (both in ARFF attribute order).
  Zero feature values are dropped.

  Returns:
    (features CSR float32 (N, d), labels CSR float32 (N, K), label names (K,)).
  """
  xml_names = set(read_mulan_label_names(xml_path))
  kind = array("b")  # +1 label, 0 feature, per attribute
  col = array("i")  # id within its kind
  label_names: list[str] = []
  n_feat = 0
  feats, labs = xc_format._CsrBuilder(), xc_format._CsrBuilder()
  in_data = False
  for lineno, raw in xc_format._lines(arff_path):
    line = raw.decode("utf-8", "replace").strip()
    if not line or line.startswith("%"):
      continue
    if not in_data:
      low = line.lower()
      if low.startswith("@attribute"):
        m = _ATTR_RE.match(line)
        if m is None:
          raise DataFormatError(arff_path, lineno, "malformed @attribute line")
        name = _unquote(m.group(1))
        if name in xml_names:
          kind.append(1)
          col.append(len(label_names))
          label_names.append(name)
        else:
          kind.append(0)
          col.append(n_feat)
          n_feat += 1
      elif low.startswith("@data"):
        in_data = True
        if len(label_names) != len(xml_names):
          raise DataFormatError(
              arff_path, lineno, f"{len(xml_names) - len(label_names)} labels of the XML "
              "header are not ARFF attributes")
      elif not low.startswith("@relation"):
        raise DataFormatError(arff_path, lineno, f"unexpected header line {line[:60]!r}")
      continue
    if line.startswith("{"):
      if not line.endswith("}"):
        raise DataFormatError(arff_path, lineno, "sparse row without closing '}'")
      body = line[1:-1].strip()
      pairs = [p.split() for p in body.split(",")] if body else []
    else:
      pairs = [[str(i), v.strip()] for i, v in enumerate(line.split(","))]
      if len(pairs) != len(kind):
        raise DataFormatError(
            arff_path, lineno, f"dense row has {len(pairs)} values, expected {len(kind)}")
    f_ids, f_vals, l_ids = [], [], []
    for p in pairs:
      if len(p) != 2 or not p[0].isdigit() or int(p[0]) >= len(kind):
        raise DataFormatError(arff_path, lineno, f"malformed entry {' '.join(p)!r}")
      a = int(p[0])
      try:
        v = float(p[1])
      except ValueError:
        raise DataFormatError(arff_path, lineno, f"non-numeric value {p[1]!r}") from None
      if not np.isfinite(v):
        raise DataFormatError(arff_path, lineno, f"non-finite value {p[1]!r}")
      if kind[a]:
        if v not in (0.0, 1.0):
          raise DataFormatError(arff_path, lineno, f"label value {p[1]!r} is not 0/1")
        if v:
          l_ids.append(col[a])
      elif v != 0.0:
        f_ids.append(col[a])
        f_vals.append(v)
    if any(a >= b for a, b in zip(f_ids, f_ids[1:])):
      if len(set(f_ids)) != len(f_ids):
        raise DataFormatError(arff_path, lineno, "duplicate attribute in a sparse row")
      f_ids, f_vals = map(list, zip(*sorted(zip(f_ids, f_vals))))
    feats.add_row(f_ids, f_vals)
    l_ids.sort()
    labs.add_row(l_ids, [1.0] * len(l_ids))
  if not in_data:
    raise DataFormatError(arff_path, None, "no @data section")
  n = len(feats.indptr) - 1
  return feats.build((n, n_feat)), labs.build((n, len(label_names))), label_names


def mulan_to_xc(arff_path, xml_path, out_path) -> None:
  """Converts a Mulan ARFF (+ XML label header) to an XC text file."""
  features, labels, _ = read_mulan_arff(arff_path, xml_path)
  out_path = Path(out_path)
  tmp = out_path.with_name(out_path.name + ".part")
  xc_format.write_xc(tmp, features, labels)
  os.replace(tmp, out_path)


def load_or_download(name: str, split: str = "train", data_dir=None) -> datasets.XCDataset:
  """`datasets.load_dataset`, fetching a registered dataset into `data_dir` (default: the
  cache) first when no search root has it (needs internet; training never calls this)."""
  if datasets.find_dataset(name, split, data_dir) is None:
    download_dataset(name, cache_dir=data_dir)
  return datasets.load_dataset(name, split, data_dir)
