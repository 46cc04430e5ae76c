"""Rows with images through a real API server (docs/vision.md): data URLs and http(s) URLs (served by a local
HTTP server this module starts) are checked at upload and kept with the file; every hostile image is a
400 naming its line and field that leaves nothing stored; loopback and private addresses are refused
unless the operator allows them; an image larger than the line cap streams through; and a job refuses
image rows on a text model, with a method that takes none, or packed.
"""

from __future__ import annotations

import io
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from PIL import Image

from tests.conftest import IDLE, VISION_MODELS, _stop, new_key, start_server
from tests.helpers import jsonl, stored_counts, tenant_of, upload
from tests.vision_families import data_url, image_bytes, image_part, image_row

RED_PNG = image_bytes((40, 30), (220, 20, 20))
JPEG = image_bytes((30, 20), (20, 20, 220), "JPEG")


def _png(size: tuple[int, int], mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size).save(out, format="PNG")
    return out.getvalue()


class _Images(BaseHTTPRequestHandler):
    """The local image server: each path a case (module docstring); ``hits`` counts requests by path."""

    hits: ClassVar[dict[str, int]] = {}
    routes: ClassVar[dict[str, tuple[int, dict[str, str], bytes]]] = {
        "/red.png": (200, {"Content-Type": "image/png"}, RED_PNG),
        "/photo": (200, {"Content-Type": "image/jpeg"}, JPEG),
        "/no-type": (200, {}, RED_PNG),
        "/wrong-type.png": (200, {"Content-Type": "image/png"}, JPEG),
        "/page": (200, {"Content-Type": "text/html"}, b"<html>not an image</html>"),
        "/missing.png": (404, {}, b""),
        "/to-red": (302, {"Location": "/red.png"}, b""),
        "/loop": (302, {"Location": "/loop"}, b""),
    }

    def do_GET(self) -> None:
        _Images.hits[self.path] = _Images.hits.get(self.path, 0) + 1
        if self.path == "/slow":
            time.sleep(4)
        if self.path == "/huge":  # says more than the limit before sending anything
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(64 * 1024 * 1024))
            self.end_headers()
            return
        status, headers, body = self.routes.get(self.path, (200, {"Content-Type": "image/png"}, RED_PNG))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture(scope="module")
def images_site() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def fetching_api() -> Iterator[str]:
    """A server whose operator allows fetching private addresses (the local image server), with a 2 s
    fetch timeout and uploads up to 40 MB."""
    url, proc = start_server(
        {
            **IDLE,
            "TUNEHOUSE_IMAGE_FETCH_ALLOW_PRIVATE": "true",
            "TUNEHOUSE_IMAGE_FETCH_TIMEOUT_SECONDS": "2",
            "TUNEHOUSE_MAX_UPLOAD_BYTES": str(40 * 1024 * 1024),
        }
    )
    yield url
    _stop(proc)


@pytest.fixture
def fetching(fetching_api: str) -> Iterator[tuple[httpx.Client, str]]:
    key = new_key()
    with httpx.Client(base_url=fetching_api, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        yield c, key


def _refused(
    client: httpx.Client, key: str, rows: list[dict[str, Any]], line: int, field: str, words: str
) -> None:
    before = stored_counts(tenant_of(key))
    response = upload(client, jsonl(rows))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "file" and error["code"] == "invalid_file"
    assert error["message"].startswith(f"line {line}: field {field!r}: "), error["message"]
    assert words in error["message"], error["message"]
    assert stored_counts(tenant_of(key)) == before  # nothing stored: no row, no blob, no temp file


def test_data_url_rows_upload_with_their_images_listed(client: httpx.Client) -> None:
    two = image_row(data_url(RED_PNG))
    two["messages"][1]["content"].append(image_part(data_url(JPEG, "image/jpeg"), "low"))
    rows = [
        image_row(data_url(image_bytes(fmt="WEBP"), "image/webp")),
        two,
        {"messages": [two["messages"][0], two["messages"][2]]},
    ]
    data = jsonl(rows)
    response = upload(client, data)
    assert response.status_code == 200, response.text
    file = response.json()
    assert file["images"] == 3 and file["line_count"] == 3 and file["bytes"] == len(data)
    assert client.get(f"/v1/files/{file['id']}/content").content == data  # stored as sent

    page = client.get(f"/v1/files/{file['id']}/images", params={"limit": 2}).json()
    assert page["has_more"] and [i["id"] for i in page["data"]] == ["0", "1"]
    rest = client.get(f"/v1/files/{file['id']}/images", params={"after": "1"}).json()
    images = page["data"] + rest["data"]
    assert not rest["has_more"] and len(images) == 3
    assert [
        (i["line"], i["field"], i["media_type"], i["width"], i["height"], i["detail"]) for i in images
    ] == [
        (1, "messages[1].content[1]", "image/webp", 40, 30, "auto"),
        (2, "messages[1].content[1]", "image/png", 40, 30, "auto"),
        (2, "messages[1].content[2]", "image/jpeg", 30, 20, "low"),
    ]
    assert all(i["url"] is None and i["thumbnail"].startswith("data:image/webp;base64,") for i in images)
    bad = client.get(f"/v1/files/{file['id']}/images", params={"after": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"


def _bomb() -> bytes:
    """A PNG whose header says 20,000 x 20,000 pixels (1.2 GB decoded) over a few bytes of data: what a
    decompression bomb shows before it is decoded (a real one, 1.2 MB of zeros, takes 12 s to write)."""
    png = bytearray(_png((1, 1)))
    png[16:24] = struct.pack(">II", 20_000, 20_000)  # IHDR's width and height
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))  # and its CRC
    return bytes(png)


HOSTILE = {
    "truncated": (lambda: data_url(RED_PNG[: len(RED_PNG) // 2]), "damaged or truncated"),
    "decompression bomb": (lambda: data_url(_bomb()), "decompression bomb"),
    "1x100000": (lambda: data_url(_png((1, 100_000))), "aspect ratio"),
    "wrong MIME": (lambda: data_url(JPEG, "image/png"), "declared image/png, but the data is a JPEG"),
    "not an image type": (
        lambda: "data:image/gif;base64,R0lGODlhAQABAAAAACw=",
        "unsupported image media type",
    ),
    "grayscale": (lambda: data_url(_png((8, 8), "L")), "image mode 'L'"),
    "not base64": (lambda: "data:image/png;base64,iVBO%%%%", "not valid base64"),
    "not a URL we take": (lambda: "file:///etc/passwd", "expected a data: URL (base64) or an http(s) URL"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_image_is_a_400_naming_it_and_leaves_nothing_stored(
    client: httpx.Client, api_key: str, case: str
) -> None:
    url, words = HOSTILE[case]
    rows = [image_row(data_url(RED_PNG)), image_row(url())]
    _refused(client, api_key, rows, 2, "messages[1].content[1].image_url.url", words)


def test_the_limits_of_an_example_and_the_roles_that_take_images(client: httpx.Client, api_key: str) -> None:
    eleven = image_row(data_url(RED_PNG))
    eleven["messages"][1]["content"] += [image_part(data_url(RED_PNG))] * 10
    _refused(client, api_key, [eleven], 1, "messages[1].content[11]", "more than 10 images in one example")
    answer = image_row(data_url(RED_PNG))
    answer["messages"][2]["content"] = [image_part(data_url(RED_PNG))]
    _refused(client, api_key, [answer], 1, "messages[2].content[0]", "user and system messages only")


def test_an_image_larger_than_the_line_cap_streams_through(fetching: tuple[httpx.Client, str]) -> None:
    client, _ = fetching
    noise = Image.frombytes("RGB", (1600, 1400), os.urandom(1600 * 1400 * 3))
    out = io.BytesIO()
    noise.save(out, format="PNG")
    assert len(out.getvalue()) * 4 / 3 > 4 * 1024 * 1024  # its line would be over the 4 MB line cap
    response = upload(client, jsonl([image_row(data_url(out.getvalue()))]))
    assert response.status_code == 200, response.text
    assert response.json()["images"] == 1


def test_http_images_are_fetched_once_and_kept_with_the_file(
    fetching: tuple[httpx.Client, str], images_site: str
) -> None:
    from service.config import get_settings

    client, key = fetching
    _Images.hits.clear()
    rows = [
        image_row(f"{images_site}/red.png"),
        image_row(f"{images_site}/red.png"),
        image_row(f"{images_site}/to-red"),
    ]
    rows.append(image_row(f"{images_site}/photo"))
    response = upload(client, jsonl(rows))
    assert response.status_code == 200, response.text
    file = response.json()
    assert _Images.hits == {"/red.png": 2, "/to-red": 1, "/photo": 1}  # red.png again through the redirect
    images = client.get(f"/v1/files/{file['id']}/images").json()["data"]
    assert [i["url"] for i in images] == [r["messages"][1]["content"][1]["image_url"]["url"] for r in rows]
    assert [i["media_type"] for i in images] == ["image/png"] * 3 + ["image/jpeg"]
    folder = get_settings().data_dir / "blobs" / "files" / tenant_of(key)
    assert sorted(p.name for p in (folder / f"{file['id']}.images").iterdir()) == sorted(
        {images[0]["sha256"], images[3]["sha256"]}
    )
    assert client.delete(f"/v1/files/{file['id']}").status_code == 200
    assert not [p for p in folder.rglob("*") if p.is_file()]  # the file, its images and manifest: gone


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("/wrong-type.png", "declared image/png, but the data is a JPEG"),
        ("/page", "not a readable image"),
        ("/missing.png", "answered HTTP 404"),
        ("/loop", "redirects more than 3 times"),
        ("/huge", "more than the limit"),
        ("/slow", "fetching the image"),
    ],
)
def test_an_http_image_that_fails_is_a_400_naming_it(
    fetching: tuple[httpx.Client, str], images_site: str, path: str, words: str
) -> None:
    client, key = fetching
    rows = [image_row(f"{images_site}/red.png"), image_row(f"{images_site}{path}")]
    _refused(client, key, rows, 2, "messages[1].content[1].image_url.url", words)


@pytest.mark.parametrize(
    "host", ["127.0.0.1:{port}", "localhost:{port}", "169.254.169.254", "[::1]", "10.0.0.7"]
)
def test_private_and_loopback_addresses_are_refused_unless_allowed(
    client: httpx.Client, api_key: str, images_site: str, host: str
) -> None:
    port = images_site.rsplit(":", 1)[1]
    _Images.hits.clear()
    rows = [image_row(f"http://{host.format(port=port)}/red.png")]
    _refused(
        client, api_key, rows, 1, "messages[1].content[1].image_url.url", "private, loopback or reserved"
    )
    assert _Images.hits == {}  # never connected


# -- job creation --------------------------------------------------------------------------------------


def _job(
    client: httpx.Client, model: str, file_id: str, method: str = "supervised", **hp: Any
) -> httpx.Response:
    body = {
        "model": model,
        "training_file": file_id,
        "method": {"type": method, method: {"hyperparameters": hp}},
    }
    if method == "grpo":
        grader = {
            "type": "string_check",
            "name": "x",
            "operation": "eq",
            "input": "{{sample.output_text}}",
            "reference": "a",
        }
        body["method"][method]["grader"] = grader
    return client.post("/v1/fine_tuning/jobs", json=body)


def test_a_job_refuses_images_on_a_text_model_a_method_without_them_or_packed(
    client: httpx.Client, vision_models: dict[str, Path], chat_model: str
) -> None:
    file_id = upload(client, jsonl([image_row(data_url(RED_PNG))])).json()["id"]
    refused = _job(client, chat_model, file_id).json()["error"]
    assert refused["param"] == "model" and refused["code"] == "model_takes_no_images"
    assert f"model '{chat_model}' takes text only" in refused["message"] and "1 images" in refused["message"]
    packed = _job(client, VISION_MODELS["gemma3"], file_id, packing=True).json()["error"]
    assert packed["param"] == "method.supervised.hyperparameters.packing"
    prompts = [{"messages": image_row(data_url(RED_PNG))["messages"][:2]}]
    prompt_file = upload(client, jsonl(prompts)).json()["id"]
    grpo = _job(client, VISION_MODELS["gemma3"], prompt_file, "grpo").json()["error"]
    assert grpo["param"] == "method.type" and "the methods that do: dpo, supervised" in grpo["message"]
    text_file = upload(
        client,
        jsonl([{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]),
    ).json()["id"]
    tower = _job(client, chat_model, text_file, train_vision_tower=True).json()["error"]
    assert tower["param"] == "method.supervised.hyperparameters.train_vision_tower"
    created = _job(client, VISION_MODELS["gemma3"], file_id)
    assert created.status_code == 200 and created.json()["status"] == "queued", created.text


def test_a_job_trains_on_the_images_its_file_fetched(
    fetching: tuple[httpx.Client, str], images_site: str, vision_models: dict[str, Path], tmp_path: Path
) -> None:
    """What a job's worker does with a file of http(s) images (worker/file_images.py, then the trainer):
    the images kept at upload, copied beside the job with their index, read by the rows' URLs; without
    them a URL is refused naming its field (nothing is fetched by a trainer)."""
    from service.files.service import new_blob_key
    from service.storage import get_blob_store
    from trainers.core.errors import DataError
    from trainers.data.jsonl_rows import JsonlRows
    from trainers.methods.sft import SFTConfig, train_sft
    from worker.file_images import fetched_images

    client, key = fetching
    rows = [image_row(f"{images_site}/red.png", "Red."), image_row(f"{images_site}/photo", "Blue.")]
    file = upload(client, jsonl(rows)).json()
    blob_key = new_blob_key(tenant_of(key), file["id"])
    local = tmp_path / "train.jsonl"
    with local.open("wb") as fh:
        get_blob_store().copy_to(blob_key, fh)
    images_dir = fetched_images(get_blob_store(), [blob_key], workdir=tmp_path)
    assert images_dir is not None and len(list(images_dir.iterdir())) == 3  # two images and the index
    config = SFTConfig(
        str(vision_models["gemma3"]),
        str(tmp_path / "out"),
        batch_size=2,
        max_steps=1,
        images_dir=str(images_dir),
    )
    assert train_sft(config, JsonlRows(local, param="training_file")).steps == 1
    config.images_dir = None
    with pytest.raises(DataError, match=r"line 1: field 'messages\[1\].content\[1\].image_url.url': an http"):
        train_sft(config, JsonlRows(local, param="training_file"))


def test_the_catalogue_says_a_vision_base_takes_images_and_what_trains_it(
    vision_models: dict[str, Path],
) -> None:
    from service.base_models.details import model_details

    details = model_details(vision_models["idefics3"])
    assert details["modalities"] == ["text", "image"]
    assert details["trainable"] == {
        "methods": ["supervised", "dpo"],
        "lora": True,
        "full": True,
        "quantization": [],
    }
