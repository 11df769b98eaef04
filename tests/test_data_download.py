"""Tests of dataset download (against a local 127.0.0.1 HTTP server) and ARFF -> XC conversion."""
import contextlib
import functools
import gzip
import hashlib
import http.server
import socket
import threading

import numpy as np
import pytest

from snm_jax.data import datasets
from snm_jax.data import download
from snm_jax.errors import DataFormatError

TINY_XML = b"""<?xml version="1.0" encoding="utf-8"?>
<labels xmlns="http://mulan.sourceforge.net/labels">
<label name="tag_a"></label>
<label name="tag b"></label>
</labels>
"""
# Attributes: f0, tag_a (label 0), f1, 'tag b' (label 1, quoted), f2.
TINY_HEAD = b"""@relation tiny
% a comment
@attribute f0 numeric
@attribute tag_a {0,1}
@attribute f1 numeric
@attribute 'tag b' {0,1}
@attribute f2 {0,1}

@data
"""
TINY_TRAIN = TINY_HEAD + b"{0 2.5,1 1,4 1}\n{2 1,3 1,1 1}\n{}\n0,0,3,1,0\n"
TINY_TEST = TINY_HEAD + b"{4 1}\n"
# Expected XC conversion (feature ids f0, f1, f2 = 0, 1, 2; sorted label lists).
TINY_TRAIN_XC = b"4 3 2\n0 0:2.5 2:1\n0,1 1:1\n\n1 1:3\n"
TINY_TEST_XC = b"1 3 2\n 2:1\n"


def _sha(b):
  return hashlib.sha256(b).hexdigest()


class _Handler(http.server.SimpleHTTPRequestHandler):
  requests = []

  def log_message(self, *args):
    pass

  def do_GET(self):
    type(self).requests.append(self.path)
    super().do_GET()


@contextlib.contextmanager
def _serve(directory):
  """An HTTP server on 127.0.0.1 serving `directory`, in a background thread."""
  _Handler.requests = []
  server = http.server.ThreadingHTTPServer(
      ("127.0.0.1", 0), functools.partial(_Handler, directory=str(directory)))
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield f"http://127.0.0.1:{server.server_address[1]}"
  finally:
    server.shutdown()
    server.server_close()
    thread.join()


def _tiny_spec(root, base_url="http://unused.invalid", train=TINY_TRAIN):
  (root / "tiny").mkdir(parents=True, exist_ok=True)
  for name, content in (("tiny-train.arff", train), ("tiny-test.arff", TINY_TEST),
                        ("tiny.xml", TINY_XML)):
    (root / "tiny" / name).write_bytes(content)
  return download.RemoteDataset(
      name="tiny", base_url=base_url, kind="mulan",
      files=(download.RemoteFile("tiny/tiny-train.arff", _sha(TINY_TRAIN)),
             download.RemoteFile("tiny/tiny-test.arff", _sha(TINY_TEST)),
             download.RemoteFile("tiny/tiny.xml", _sha(TINY_XML))))


def test_download_converts_and_loads(tmp_path):
  spec = _tiny_spec(tmp_path / "www")
  cache = tmp_path / "cache"
  with _serve(tmp_path / "www") as url:
    folder = download.download_dataset(spec, cache_dir=cache, base_url=url)
    assert folder == cache / "tiny"
    assert (folder / "tiny_train.txt").read_bytes() == TINY_TRAIN_XC
    assert (folder / "tiny_test.txt").read_bytes() == TINY_TEST_XC
    assert (folder / "tiny_labels.txt").read_text().splitlines() == ["tag_a", "tag b"]
    assert len(_Handler.requests) == 3
    # Second call: files verified in the cache, nothing fetched again.
    download.download_dataset(spec, cache_dir=cache, base_url=url)
    assert len(_Handler.requests) == 3
  ds = datasets.load_dataset("tiny", "train", data_dir=cache)
  np.testing.assert_array_equal(ds.features.toarray(),
                                [[2.5, 0, 1], [0, 1, 0], [0, 0, 0], [0, 3, 0]])
  np.testing.assert_array_equal(ds.labels.toarray(), [[1, 0], [1, 1], [0, 0], [0, 1]])
  assert ds.label_names == ["tag_a", "tag b"]
  assert not list(cache.rglob("*.part"))


def test_checksum_mismatch_keeps_nothing(tmp_path):
  spec = _tiny_spec(tmp_path / "www", train=TINY_TRAIN)
  (tmp_path / "www" / "tiny" / "tiny-train.arff").write_bytes(TINY_TRAIN + b"% tampered\n")
  with _serve(tmp_path / "www") as url:
    with pytest.raises(download.ChecksumError, match="sha256 mismatch.*tiny-train.arff"):
      download.download_dataset(spec, cache_dir=tmp_path / "cache", base_url=url)
  assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def test_offline_and_http_errors_are_typed(tmp_path):
  spec = _tiny_spec(tmp_path / "www")
  with socket.socket() as s:  # a port with nobody listening: connection refused
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
  with pytest.raises(download.DownloadError, match="are you offline") as info:
    download.download_dataset(spec, cache_dir=tmp_path / "cache", base_url=dead, timeout=5)
  assert dead + "/tiny/tiny-train.arff" in str(info.value)
  assert isinstance(info.value, OSError)
  (tmp_path / "empty").mkdir()
  with _serve(tmp_path / "empty") as url:
    with pytest.raises(download.DownloadError, match="HTTP 404"):
      download.download_dataset(spec, cache_dir=tmp_path / "cache", base_url=url)
  with pytest.raises(KeyError, match="no download registered"):
    download.download_dataset("no-such-dataset", cache_dir=tmp_path)


def test_load_or_download_fetches_a_missing_dataset(tmp_path):
  spec = _tiny_spec(tmp_path / "www")
  with _serve(tmp_path / "www") as url:
    download.register_dataset(download.RemoteDataset(spec.name, url, spec.kind, spec.files))
    try:
      ds = download.load_or_download("tiny", "test", data_dir=tmp_path / "cache")
    finally:
      del download.REGISTRY["tiny"]
  np.testing.assert_array_equal(ds.features.toarray(), [[0, 0, 1]])


@pytest.mark.parametrize("body,line,words", [
    (b"@relation r\n@attribute f0 numeric\n@data\n{0 1}\n", 3, "labels of the XML"),
    (TINY_HEAD + b"{0 1,1 2}\n", 10, "label value '2' is not 0/1"),
    (TINY_HEAD + b"{0 1,9 1}\n", 10, "malformed entry '9 1'"),
    (TINY_HEAD + b"{0 1\n", 10, "without closing"),
    (TINY_HEAD + b"1,0,?,0,0\n", 10, "non-numeric value '?'"),
    (TINY_HEAD + b"1,0,0\n", 10, "dense row has 3 values"),
])
def test_malformed_arff(tmp_path, body, line, words):
  (tmp_path / "x.arff").write_bytes(body)
  (tmp_path / "x.xml").write_bytes(TINY_XML)
  with pytest.raises(DataFormatError) as info:
    download.read_mulan_arff(tmp_path / "x.arff", tmp_path / "x.xml")
  assert info.value.line == line and words in str(info.value), str(info.value)


def test_registry_checksums_match_the_shared_originals(shared_data_dir):
  for name in ("bibtex", "delicious"):
    spec = download.REGISTRY[name]
    train, test, xml = spec.files
    assert _sha(gzip.decompress((shared_data_dir / name / f"{name}-train.arff.gz").read_bytes())
                ) == train.sha256
    assert _sha(gzip.decompress((shared_data_dir / name / f"{name}-test.arff.gz").read_bytes())
                ) == test.sha256
    assert _sha((shared_data_dir / name / f"{name}.xml").read_bytes()) == xml.sha256
    assert spec.base_url.startswith("https://raw.githubusercontent.com/tsoumakas/mulan/")


def test_download_of_real_bibtex_reproduces_the_shared_files(shared_data_dir, tmp_path):
  """Serve the original Mulan files locally; the download path yields the bundled XC files."""
  www = tmp_path / "www" / "bibtex"
  www.mkdir(parents=True)
  for split in ("train", "test"):
    (www / f"bibtex-{split}.arff").write_bytes(
        gzip.decompress((shared_data_dir / "bibtex" / f"bibtex-{split}.arff.gz").read_bytes()))
  (www / "bibtex.xml").write_bytes((shared_data_dir / "bibtex" / "bibtex.xml").read_bytes())
  with _serve(tmp_path / "www") as url:
    folder = download.download_dataset("bibtex", cache_dir=tmp_path / "cache", base_url=url)
  for f in ("bibtex_train.txt", "bibtex_test.txt", "bibtex_labels.txt"):
    assert (folder / f).read_bytes() == (shared_data_dir / "bibtex" / f).read_bytes(), f
