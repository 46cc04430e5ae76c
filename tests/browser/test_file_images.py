"""The files view shows a file's images (docs/vision.md): an upload of image rows lists its image count,
and opening it shows each image's thumbnail with the line it stands in, read from the API's
GET /v1/files/{id}/images."""

from __future__ import annotations

import base64

from tests.browser.conftest import UI
from tests.conftest import Stack, new_key
from tests.vision_families import data_url, image_bytes, image_part, image_row, jsonl


def test_a_file_with_images_shows_their_thumbnails_and_lines(ui: UI, stack: Stack) -> None:
    page = ui.page
    ui.sign_in(new_key())
    page.get_by_role("navigation").get_by_role("link", name="Files").click()
    page.get_by_role("heading", name="Upload a training file").wait_for()

    two = image_row(data_url(image_bytes((40, 30), (220, 20, 20))))
    two["messages"][1]["content"].append(
        image_part(data_url(image_bytes((30, 44), (20, 20, 220), "JPEG"), "image/jpeg"))
    )
    text = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    rows = [text, two, image_row(data_url(image_bytes((64, 64), (20, 200, 20), "WEBP"), "image/webp"))]
    page.get_by_label("JSONL file").set_input_files(
        files=[{"name": "pictures.jsonl", "mimeType": "application/jsonl", "buffer": jsonl(rows)}]
    )
    page.get_by_role("button", name="Upload").click()
    row = page.locator("tr[data-file-id]", has_text="pictures.jsonl")
    row.wait_for()
    show = row.get_by_role("button", name="Show the images of pictures.jsonl")
    assert show.inner_text().startswith("3")
    show.click()
    gallery = page.get_by_role("list", name="Images of pictures.jsonl")
    gallery.wait_for()
    figures = gallery.locator("figure")
    figures.nth(2).wait_for()
    assert [f.get_attribute("data-line") for f in figures.all()] == ["2", "2", "3"]
    first = figures.nth(0).locator("img")
    assert first.get_attribute("alt") == "line 2, messages[1].content[1]: 40×30 PNG"
    src = first.get_attribute("src") or ""
    assert src.startswith("data:image/webp;base64,") and base64.b64decode(src.split(",", 1)[1])[:4] == b"RIFF"
    # the browser decoded the thumbnail: a picture, not a broken image
    assert first.evaluate("img => img.complete && img.naturalWidth > 0 && img.naturalWidth <= 96")
    assert show.get_attribute("aria-expanded") == "true"
    ui.shot("files-images")
    show.click()
    assert gallery.is_hidden()
