"""The dashboard's Tinker page lists the tenant's Tinker runs (the official `tinker` SDK driving a real
Tinker host on the live stack) and follows their calls and loss as they happen, without a reload."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest

from tests.browser.conftest import UI
from tests.conftest import Stack, _stop, new_key
from tests.helpers import start_tinker_host

tinker = pytest.importorskip("tinker")  # the dev extra pins it
from tinker import types  # noqa: E402

# the SDK's one-off start-up connection pool, collected later (tests/tinker/test_sdk.py says why)
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
os.environ["TINKER_TELEMETRY"] = "0"


@pytest.fixture(scope="module")
def host(stack: Stack) -> Iterator[None]:
    proc = start_tinker_host({**os.environ, "TINKER_TELEMETRY": "0", "OMP_NUM_THREADS": "1"})
    yield
    _stop(proc)
    gc.collect()  # the SDK's unclosed transports, under this module's warning filter


def test_tinker_runs_are_listed_with_their_calls_and_loss(ui: UI, stack: Stack, host: None) -> None:
    key = new_key()
    service = tinker.ServiceClient(base_url=stack.url, api_key=f"tml-{key}")
    training = service.create_lora_training_client(base_model="tunehouse/tiny-llama", rank=4, seed=0).result()
    tokens = [5 + 7 * j for j in range(10)]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    loss = training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    ui.sign_in(key)
    ui.goto("tinker")
    row = ui.page.locator(f'tr[data-run-id="{training.model_id}"]')
    row.wait_for()
    assert row.locator('[data-field="calls"]').inner_text() == "3"  # create, forward_backward, optim_step
    assert float(row.locator('[data-field="loss"]').inner_text()) == pytest.approx(loss, rel=1e-3)
    ui.shot("tinker-runs")
    # a new call shows up with no reload
    training.forward_backward([datum], "cross_entropy").result()
    ui.page.locator(f'tr[data-run-id="{training.model_id}"] [data-field="calls"]:text-is("4")').wait_for()
    # another tenant's page does not list it
    ui.page.get_by_role("button", name="Sign out").click()
    ui.sign_in(new_key())
    ui.goto("tinker")
    ui.page.get_by_text("No Tinker runs yet.").wait_for()
    assert ui.page.locator(f'tr[data-run-id="{training.model_id}"]').count() == 0
