"""Forms put the server's answer where the user is looking: a bad upload's line-level error next to
the file input; a job spec's 400 next to the field its `param` names."""

from __future__ import annotations

import json

import httpx

from tests.browser.conftest import UI
from tests.conftest import Stack, new_key
from tests.helpers import chat_rows, jsonl, upload_ok


def test_upload_shows_the_line_error_then_uploads_and_deletes(ui: UI, stack: Stack) -> None:
    page = ui.page
    ui.sign_in(new_key())
    page.get_by_role("navigation").get_by_role("link", name="Files").click()
    page.get_by_role("heading", name="Upload a training file").wait_for()

    bad = jsonl(chat_rows(3)) + b'{"messages": "not a list"}\n'
    ui.allow(r"http 400: POST .*/v1/files|status of 400")
    page.get_by_label("JSONL file").set_input_files(
        files=[{"name": "bad.jsonl", "mimeType": "application/jsonl", "buffer": bad}]
    )
    page.get_by_role("button", name="Upload").click()
    error = page.locator("#upload-error")
    error.filter(has_text="line 4").wait_for()
    assert "messages" in error.inner_text(), error.inner_text()
    assert page.get_by_label("JSONL file").get_attribute("aria-invalid") == "true"
    ui.shot("files-upload-error")

    page.get_by_label("JSONL file").set_input_files(
        files=[{"name": "good.jsonl", "mimeType": "application/jsonl", "buffer": jsonl(chat_rows(12))}]
    )
    page.get_by_role("button", name="Upload").click()
    row = page.locator("tr[data-file-id]", has_text="good.jsonl")
    row.wait_for()
    assert error.inner_text() == ""
    cells = row.locator("td").all_inner_texts()
    assert cells[1] == "chat" and cells[3] == "12", cells
    ui.shot("files")

    delete = row.get_by_role("button", name="Delete good.jsonl")
    delete.click()
    assert page.locator("tr[data-file-id]", has_text="good.jsonl").count() == 1  # first click only arms it
    delete.click()
    page.locator("tr[data-file-id]", has_text="good.jsonl").wait_for(state="detached")


def test_new_job_form_shows_the_param_error_in_place(ui: UI, stack: Stack) -> None:
    key = new_key()
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        train = upload_ok(client, chat_rows(8))
        page = ui.page
        ui.sign_in(key)
        page.get_by_role("navigation").get_by_role("link", name="New job").click()
        page.get_by_label("Training file").select_option(train)

        # hyperparameters come from GET /v1/methods: defaults and ranges shown as the API declares them
        methods = {m["id"]: m for m in client.get("/v1/methods").json()["data"]}
        n_epochs = methods["supervised"]["hyperparameters"]["properties"]["n_epochs"]
        hint = page.locator("#hp-n_epochs-hint").inner_text()
        assert 'default "auto"' in hint and f"≤ {n_epochs['anyOf'][0]['maximum']}" in hint, hint

        ui.allow(r"http 400: POST .*/v1/fine_tuning/jobs|status of 400")
        page.get_by_label("n_epochs").fill("1000")
        page.get_by_role("button", name="Create job").click()
        field = page.locator('.field[data-param="method.supervised.hyperparameters.n_epochs"]')
        field.locator(".field-error").filter(has_text="n_epochs").wait_for()
        assert page.get_by_label("n_epochs").get_attribute("aria-invalid") == "true"
        assert page.evaluate("document.activeElement.id") == "hp-n_epochs"
        ui.shot("new-job-param-error")

        page.get_by_label("n_epochs").fill("1")
        page.get_by_label("Suffix (optional)").fill("not a valid suffix!")
        page.get_by_role("button", name="Create job").click()
        page.locator('.field[data-param="suffix"] .field-error').filter(has_text="suffix").wait_for()
        assert field.locator(".field-error").inner_text() == ""

        # an RL method brings the grader editor; its JSON is checked before sending
        page.get_by_label("Method").select_option("grpo")
        grader = page.get_by_label("Grader (JSON)")
        assert json.loads(grader.input_value())["type"] == "string_check"
        grader.fill('{"type": "string_check",')
        page.locator('.field[data-param="method.grpo.grader"] .field-error').filter(
            has_text="Invalid JSON"
        ).wait_for()
        page.get_by_label("Method").select_option("supervised")

        page.get_by_label("Training file").select_option(train)
        page.get_by_label("Suffix (optional)").fill("from-the-form")
        page.get_by_label("Metadata (optional JSON object)").fill('{"team": "ui"}')
        page.get_by_role("button", name="Create job").click()
        page.wait_for_url("**/#/jobs/ftjob*")
        job_id = page.url.split("#/jobs/")[1]
        job = client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
        assert job["user_provided_suffix"] == "from-the-form" and job["metadata"] == {"team": "ui"}
        assert job["method"]["supervised"]["hyperparameters"]["n_epochs"] == 1
        client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")  # keep the shared worker free


def test_new_job_form_shows_the_estimate_before_submitting(ui: UI, stack: Stack) -> None:
    key = new_key()
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        train = upload_ok(client, chat_rows(8))
        page = ui.page
        ui.sign_in(key)
        page.get_by_role("navigation").get_by_role("link", name="New job").click()
        page.get_by_label("Training file").select_option(train)
        page.get_by_label("n_epochs").fill("2")
        page.get_by_role("button", name="Estimate").click()
        box = page.locator("#nj-estimate")
        box.get_by_role("heading", name="Estimate").wait_for(timeout=120_000)
        expected = client.post(
            "/v1/fine_tuning/jobs/estimate",
            json={
                "model": "tunehouse/tiny-llama",
                "training_file": train,
                "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2}}},
            },
        ).json()
        tokens = expected["trained_tokens"]
        assert f"{tokens['per_epoch']} per epoch, {tokens['total']} in all" in box.inner_text()
        # the first example's trained tokens are highlighted: the assistant's answer, not the question
        marked = box.locator("pre.preview").first.locator("mark").all_inner_texts()
        assert any("0 plus 0 is 0." in m for m in marked) and not any("What is" in m for m in marked)
        ui.shot("new-job-estimate")
        assert client.get("/v1/fine_tuning/jobs").json()["data"] == []  # nothing was created
