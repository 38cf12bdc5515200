"""The web console in a real browser: headless Chromium driven through chromium-driver
(Debian's ``chromium`` and ``chromium-driver``) with Selenium, against one ``reach dev`` with
the example agents and the complaint flow, started by this module.

A person clears the review queue without touching JSON: the inbox lists a complaint the
classifier was unsure of, its review form comes from the human node's schema, an incomplete
form shows the API's error next to the field, a valid category resumes the task until it
SUCCEEDED; a second reviewer is told who was first; cancel runs the node's ``on_cancel``. The
flow page draws the graph and the mesh page lists every instance. Each page is saved as a
screenshot at 1280×800 and at a phone's width under ``$REACH_ARTIFACTS`` (default
``<repo>/target/artifacts/console``)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from google.protobuf import json_format, struct_pb2
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select

from conftest import REPO, START_TIMEOUT, STOP_TIMEOUT, ReachProcess, reach_bin
from reach_mesh import CallOptions, MeshClient, data_part
from reach.v1 import (
    orchestrator_service_pb2,
    orchestrator_service_pb2_grpc,
    registry_service_pb2,
    registry_service_pb2_grpc,
)

COMPLAINT_FLOW = REPO / "examples/flows/complaint-flow.yaml"
#: A narrative the rules classifier recognises nothing in: confidence 0, so complaint-flow
#: sends it to its `human_review` node.
VAGUE = "I am not happy with this."
ARTIFACTS = Path(os.environ.get("REACH_ARTIFACTS", REPO / "target/artifacts")) / "console"
#: The example fleet's services (`reach dev` without --no-agents).
SIZES = {"wide": (1280, 800), "narrow": (390, 844)}

T = TypeVar("T")


class ConsoleProcess(ReachProcess):
    """``reach dev`` whose banner's ``console`` line gives the console's URL
    (:attr:`console_url`, ``http://127.0.0.1:PORT/console/inbox``)."""

    banner_lines = {"console": rb"console\s+(https?://127\.0\.0\.1:\d+/console/inbox)\s"}

    @property
    def console_url(self) -> str:
        return self.banner_values["console"]

    @property
    def base(self) -> str:
        """The console's root, ``http://127.0.0.1:PORT/console``."""
        return self.console_url.rsplit("/", 1)[0]


def wait_for(check: Callable[[], T | None], what: str, timeout: float = 20.0) -> T:
    """The first truthy value of ``check``, polled every 100 ms; fails naming ``what``."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = check()
        except WebDriverException as error:  # the page is being replaced
            value, last = None, error
        if value:
            return value
        last = value if value is not None else last
        time.sleep(0.1)
    pytest.fail(f"{what}: not within {timeout}s (last: {last!r})", pytrace=False)


@pytest.fixture(scope="module")
def dev() -> Iterator[ConsoleProcess]:
    """``reach dev`` with the example agents and the complaint flow, run from the repository
    (so it finds examples/protocol-registry.yaml), tasks in a temporary directory; every
    example agent READY before the tests start."""
    with tempfile.TemporaryDirectory(prefix="reach-console-") as tmp:
        root = Path(tmp)
        flows = root / "flows"
        flows.mkdir()
        shutil.copy(COMPLAINT_FLOW, flows / COMPLAINT_FLOW.name)
        process = ConsoleProcess(
            [
                "dev",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--edge-listen",
                "",
                "--data-dir",
                str(root / "data"),
                "--flows",
                str(flows),
            ],
            cwd=REPO,
            log=root / "reach-dev.log",
        )
        try:
            with grpc.insecure_channel(process.address) as channel:
                registry = registry_service_pb2_grpc.RegistryServiceStub(channel)

                def classifier_ready() -> bool:
                    try:
                        found = registry.ListInstances(registry_service_pb2.ListInstancesRequest(), timeout=2)
                    except grpc.RpcError:
                        return False
                    return any(
                        i.state == registry_service_pb2.INSTANCE_STATE_READY
                        and any(c.name == "complaint.classify" for c in i.spec.capabilities)
                        for i in found.instances
                    )

                wait_for(classifier_ready, "a READY complaint.classify instance", timeout=30)
            yield process
        finally:
            process.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    """One headless Chromium for the module (``--no-sandbox``: the tests may run as root)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.fail("the console's browser tests need chromium and chromedriver: apt-get install chromium chromium-driver", pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,800", "--lang=en-US"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()


def orchestrator(dev: ConsoleProcess) -> orchestrator_service_pb2_grpc.OrchestratorServiceStub:
    return orchestrator_service_pb2_grpc.OrchestratorServiceStub(grpc.insecure_channel(dev.address))


def start_waiting_complaint(dev: ConsoleProcess, task_id: str, company: str = "Acme Bank") -> None:
    """Starts a complaint-flow task the classifier is unsure of and waits until it waits in
    `human_review`."""
    stub = orchestrator(dev)
    complaint = {"complaint_id": task_id, "narrative": VAGUE, "company": company, "state": "CA"}
    stub.StartTask(
        orchestrator_service_pb2.StartTaskRequest(
            flow_id="complaint-flow", task_id=task_id, input=json_format.ParseDict(complaint, struct_pb2.Value())
        ),
        timeout=10,
    )

    def waiting() -> bool:
        task = stub.GetTask(orchestrator_service_pb2.GetTaskRequest(task_id=task_id), timeout=5).task
        return task.status == orchestrator_service_pb2.TASK_STATUS_WAITING_HUMAN

    wait_for(waiting, f"task {task_id} WAITING_HUMAN")


def shoot(browser: webdriver.Chrome, name: str, scroll_to: str = "") -> None:
    """Saves the page at each of :data:`SIZES` as ``<name>-<size>.png`` (scrolled to the
    element with id ``scroll_to`` when given), back at the window's size afterwards."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for size, (width, height) in SIZES.items():
        # The viewport itself, not the window around it, has the size.
        browser.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": size == "narrow"},
        )
        if scroll_to:
            browser.execute_script(f"document.getElementById({scroll_to!r}).scrollIntoView()")
        time.sleep(0.3)
        browser.save_screenshot(str(ARTIFACTS / f"{name}-{size}.png"))
    browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def task_status_is(browser: webdriver.Chrome, status: str) -> bool:
    """Whether the task page shows ``status``; reloads it when not."""
    shown = browser.find_elements(By.ID, "task-status")
    if shown and status in shown[0].text:
        return True
    browser.refresh()
    return False


def field(browser: webdriver.Chrome, name: str) -> WebElement:
    return browser.find_element(By.CSS_SELECTOR, f'[data-field="{name}"]')


def test_a_reviewer_clears_a_complaint_from_the_inbox(dev: ConsoleProcess, browser: webdriver.Chrome) -> None:
    start_waiting_complaint(dev, "console-review-1")
    browser.get(dev.console_url)
    card = wait_for(
        lambda: browser.find_elements(By.CSS_SELECTOR, '[data-task-id="console-review-1"]'), "the task in the inbox"
    )[0]
    assert "Classify this complaint" in card.text, card.text
    assert VAGUE in card.text and "Acme Bank" in card.text, card.text
    assert "human_review" in card.text, card.text
    shoot(browser, "inbox")

    card.find_element(By.LINK_TEXT, "console-review-1").click()
    wait_for(lambda: browser.find_elements(By.ID, "review-form"), "the review form")
    category = Select(browser.find_element(By.NAME, "f.category"))
    options = [o.get_attribute("value") for o in category.options]
    assert options == ["", "servicing", "repayment", "credit_report", "origination", "other"], options
    assert "*" in field(browser, "category").find_element(By.TAG_NAME, "label").text

    # No category: the API's `required` violation shows under the category field.
    browser.find_element(By.NAME, "reviewer").send_keys("Ana")
    browser.find_element(By.ID, "submit").click()
    error = wait_for(lambda: field(browser, "category").find_elements(By.CLASS_NAME, "error"), "the category's error")[0]
    assert "required" in error.text, error.text
    assert "invalid" in (field(browser, "category").get_attribute("class") or "")
    shoot(browser, "review-invalid")

    Select(browser.find_element(By.NAME, "f.category")).select_by_value("servicing")
    browser.find_element(By.NAME, "f.note").send_keys("late fee, servicing handles it")
    browser.find_element(By.ID, "submit").click()
    wait_for(lambda: "/console/tasks/console-review-1" in browser.current_url, "the task page")

    def succeeded() -> bool:
        status = browser.find_elements(By.ID, "task-status")
        if status and "SUCCEEDED" in status[0].text:
            return True
        browser.refresh()
        return False

    wait_for(succeeded, "the task page showing SUCCEEDED")
    path = browser.find_element(By.ID, "node-path").text
    assert "classify" in path and "human_review" in path and "done" in path, path
    assert browser.find_elements(By.CSS_SELECTOR, "#timeline tbody tr"), "the timeline has rows"
    shoot(browser, "task")
    shoot(browser, "task-nodes", scroll_to="nodes")


def test_a_second_reviewer_is_told_who_was_first(dev: ConsoleProcess, browser: webdriver.Chrome) -> None:
    start_waiting_complaint(dev, "console-review-2")
    browser.get(f"{dev.base}/inbox/console-review-2")
    wait_for(lambda: browser.find_elements(By.ID, "review-form"), "the review form")
    # Someone else resumes it first (through the API, as another console would).
    orchestrator(dev).ResumeTask(
        orchestrator_service_pb2.ResumeTaskRequest(
            task_id="console-review-2", input=json_format.ParseDict({"category": "repayment"}, struct_pb2.Value())
        ),
        metadata=[("reach-reviewer", "Bo")],
        timeout=10,
    )
    Select(browser.find_element(By.NAME, "f.category")).select_by_value("servicing")
    browser.find_element(By.NAME, "reviewer").send_keys("Ana")
    browser.find_element(By.ID, "submit").click()
    notice = wait_for(lambda: browser.find_elements(By.ID, "already-resumed"), "the already-resumed notice")[0]
    assert "already resumed by Bo" in notice.text, notice.text
    assert "repayment" in browser.page_source
    shoot(browser, "already-resumed")


def test_cancel_runs_the_nodes_on_cancel(dev: ConsoleProcess, browser: webdriver.Chrome) -> None:
    start_waiting_complaint(dev, "console-review-3")
    browser.get(f"{dev.base}/inbox/console-review-3")
    wait_for(lambda: browser.find_elements(By.ID, "cancel-form"), "the cancel form")
    browser.find_element(By.ID, "reason").send_keys("duplicate")
    browser.find_element(By.ID, "cancel").click()

    def failed_at_cancelled() -> bool:
        status = browser.find_elements(By.ID, "task-status")
        if status and "FAILED" in status[0].text:
            return True
        browser.refresh()
        return False

    wait_for(failed_at_cancelled, "the task FAILED through on_cancel")
    assert "cancelled" in browser.find_element(By.ID, "node-path").text


def test_the_inbox_updates_itself(dev: ConsoleProcess, browser: webdriver.Chrome) -> None:
    browser.get(dev.console_url)
    wait_for(lambda: browser.find_elements(By.ID, "live"), "the inbox")
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-task-id="console-review-4"]')
    start_waiting_complaint(dev, "console-review-4")
    # No reload: the page's script polls and swaps its live part in.
    wait_for(
        lambda: browser.find_elements(By.CSS_SELECTOR, '[data-task-id="console-review-4"]'),
        "the new task in the open inbox",
        timeout=15,
    )
    assert "updated" in browser.find_element(By.ID, "live-stamp").text


def test_user_data_is_escaped_and_filters_narrow_the_inbox(dev: ConsoleProcess, browser: webdriver.Chrome) -> None:
    hostile = '<img src=x onerror="window.__xss=1"><script>window.__xss=2</script>'
    start_waiting_complaint(dev, "console-review-5", company=hostile)
    browser.get(f"{dev.base}/inbox?flow=complaint-flow&node=human_review")
    card = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, '[data-task-id="console-review-5"]'), "the task")[0]
    assert hostile in card.text, card.text  # shown as text, not run
    assert browser.execute_script("return window.__xss === undefined")
    browser.get(f"{dev.base}/inbox/console-review-5")
    wait_for(lambda: browser.find_elements(By.ID, "review-form"), "the review form")
    assert browser.execute_script("return window.__xss === undefined")
    browser.get(f"{dev.base}/inbox?node=some_other_node")
    wait_for(lambda: browser.find_elements(By.ID, "live"), "the filtered inbox")
    assert not browser.find_elements(By.CSS_SELECTOR, "[data-task-id]")
    assert "0 tasks waiting" in browser.find_element(By.TAG_NAME, "main").text


def test_the_flow_page_draws_the_graph(dev: ConsoleProcess, browser: webdriver.Chrome) -> None:
    browser.get(f"{dev.base}/flows/complaint-flow")
    graph = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#flow-graph svg"), "the flow graph")[0]
    nodes = {n.get_attribute("data-node") for n in graph.find_elements(By.CSS_SELECTOR, "g.node")}
    assert nodes == {
        "classify", "route", "servicing", "repayment", "credit_report", "origination", "human_review", "cancelled", "done",
    }, nodes
    assert len(graph.find_elements(By.CSS_SELECTOR, "path.edge")) >= 12
    review = graph.find_element(By.CSS_SELECTOR, 'g.node[data-node="human_review"] g.count')
    assert int(review.text.strip()) >= 1, review.text
    shoot(browser, "flow")


def test_the_mesh_page_lists_every_instance(dev: ConsoleProcess, browser: webdriver.Chrome) -> None:
    with grpc.insecure_channel(dev.address) as channel:
        registry = registry_service_pb2_grpc.RegistryServiceStub(channel)
        instances = registry.ListInstances(registry_service_pb2.ListInstancesRequest(), timeout=5).instances
    expected = {i.spec.instance_id for i in instances}
    assert len(expected) >= 5, expected
    browser.get(f"{dev.base}/mesh")
    shown = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "tr.instance"), "the instances")
    ids = {row.get_attribute("data-instance-id") for row in shown}
    assert expected <= ids, (expected, ids)

    # The router alongside measures each instance it calls: the classifier, once called,
    # shows a latency (its p2c estimate), in ms.
    async def classify() -> None:
        async with MeshClient(dev.endpoint, "pytest.console") as mesh:
            narrative = {"complaint_id": "latency-1", "narrative": "My servicer lost my payment."}
            await mesh.call("complaint.classify", data_part(narrative), CallOptions(timeout=10))

    asyncio.run(classify())
    browser.refresh()

    def measured() -> str | None:
        cell = browser.find_element(By.CSS_SELECTOR, 'tr.instance[data-instance-id="coordinator-1"] td[data-label="latency"]')
        return None if "not measured" in cell.text else cell.text

    latency = wait_for(measured, "the classifier's latency")
    assert re.fullmatch(r"\d+\.\d\dms|\d+ms|\d+\.\ds", latency), latency
    assert browser.find_elements(By.CSS_SELECTOR, "#capabilities tbody tr")
    shoot(browser, "mesh")
    # The review cancelled above ended FAILED (its on_cancel is a `fail` node): a dead letter
    # with a retry button, which retries it (and it fails there again).
    dead_letter = '//table[@id="dead-letters"]//tr[.//a[text()="console-review-3"]]'
    row = browser.find_element(By.XPATH, dead_letter)
    assert "cancelled" in row.text, row.text
    shoot(browser, "dead-letters", scroll_to="dead-letters")

    # The page refreshes itself (refresh_ms): a row found before a refresh is stale after it,
    # so the button is found and clicked in one step, again if a refresh came in between.
    def retry_clicked() -> bool:
        browser.find_element(By.XPATH, f"{dead_letter}//button").click()
        return True

    wait_for(retry_clicked, "the dead letter's retry button")
    wait_for(lambda: "/console/tasks/console-review-3" in browser.current_url, "the retried task's page")
    browser.get(f"{dev.base}/tasks")
    assert wait_for(lambda: browser.find_elements(By.LINK_TEXT, "console-review-1"), "the task list")


def test_reach_console_serves_any_endpoint(dev: ConsoleProcess, browser: webdriver.Chrome) -> None:
    """`reach console` is the same console, as a process of its own against the mesh's
    endpoints."""
    process = subprocess.Popen(
        [str(reach_bin()), "console", "--listen", "127.0.0.1:0", "--orchestrator", dev.endpoint, "--registry", dev.endpoint],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode()
        match = re.search(r"console\s+(http://127\.0\.0\.1:\d+/console/inbox)", line)
        assert match, line
        browser.get(match.group(1))
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, '[data-task-id="console-review-4"]'), "the inbox")
        browser.get(match.group(1).replace("/inbox", "/mesh"))
        assert wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "tr.instance"), "the instances")
        # No router runs in this process: the latency column says where latencies are not.
        cell = browser.find_element(By.CSS_SELECTOR, 'tr.instance td[data-label="latency"]')
        assert cell.text == "no router here", cell.text
    finally:
        process.terminate()
        assert process.wait(STOP_TIMEOUT) == 0


def test_reach_console_refuses_to_serve_beyond_loopback_without_insecure() -> None:
    done = subprocess.run([str(reach_bin()), "console", "--listen", "0.0.0.0:0"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 64, done
    assert "--insecure" in done.stderr, done.stderr


#: A flow that waits for a person at once (the trusted mesh below runs no agents).
APPROVAL = """\
id: console-approval
version: 1
description: A person approves, then the task ends.
initial: approve
states:
  approve:
    type: human
    prompt: "Approve the request."
    schema:
      type: object
      required: [approved]
      properties:
        approved: {type: boolean, description: "Whether the request may go ahead."}
    next: done
  done: {type: succeed}
"""


def test_with_trust_on_a_person_logs_in_and_acts_as_themselves(browser: webdriver.Chrome) -> None:
    """With trust on (bearer tokens), the console asks for a token, refuses one the mesh does
    not accept, and calls the mesh with the person's token: their identity is who resumed."""
    with tempfile.TemporaryDirectory(prefix="reach-console-trust-") as tmp:
        root = Path(tmp)
        pki = root / "certs"
        subprocess.run(
            [str(reach_bin()), "certs", "init", "--dir", str(pki), "--trust-domain", "reach.test", "--operators", "admin"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        token = subprocess.run(
            [str(reach_bin()), "token", "operator", "--key", str(pki / "jwt-key.pem"), "--name", "admin", "--ttl", "1h", "--trust-domain", "reach.test"],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        config = root / "reach.toml"
        config.write_text(f'[trust]\ntrust_domain = "reach.test"\n[trust.jwt]\nkeys = ["{pki / "jwt-public.pem"}"]\n')
        flows = root / "flows"
        flows.mkdir()
        (flows / "console-approval.yaml").write_text(APPROVAL)
        process = ConsoleProcess(
            ["dev", "--config", str(config), "--no-agents", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
             "--edge-listen", "", "--data-dir", str(root / "data"), "--flows", str(flows)],
            cwd=root,
            log=root / "reach-dev.log",
        )
        try:
            bearer = [("authorization", f"Bearer {token}")]
            stub = orchestrator(process)
            stub.StartTask(
                orchestrator_service_pb2.StartTaskRequest(flow_id="console-approval", task_id="approval-1"),
                metadata=bearer,
                timeout=10,
            )
            wait_for(
                lambda: stub.GetTask(orchestrator_service_pb2.GetTaskRequest(task_id="approval-1"), metadata=bearer, timeout=5).task.status
                == orchestrator_service_pb2.TASK_STATUS_WAITING_HUMAN,
                "approval-1 WAITING_HUMAN",
            )
            browser.get(process.console_url)
            wait_for(lambda: browser.find_elements(By.ID, "login-form"), "the login page")
            browser.find_element(By.ID, "token").send_keys("not-a-token")
            browser.find_element(By.ID, "login").click()
            error = wait_for(lambda: browser.find_elements(By.ID, "login-error"), "the refusal")[0]
            assert "refuses this token" in error.text, error.text
            shoot(browser, "login-refused")
            browser.find_element(By.ID, "token").send_keys(token)
            browser.find_element(By.ID, "login").click()
            card = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, '[data-task-id="approval-1"]'), "the inbox")[0]
            assert "Approve the request." in card.text
            assert browser.find_elements(By.ID, "logout")
            card.find_element(By.LINK_TEXT, "approval-1").click()
            wait_for(lambda: browser.find_elements(By.ID, "review-form"), "the review form")
            assert not browser.find_elements(By.ID, "reviewer"), "no name to give: the token says who"
            Select(browser.find_element(By.NAME, "f.approved")).select_by_value("true")
            browser.find_element(By.ID, "submit").click()
            wait_for(lambda: task_status_is(browser, "SUCCEEDED"), "approval-1 SUCCEEDED")
            browser.get(f"{process.base}/inbox/approval-1")
            notice = wait_for(lambda: browser.find_elements(By.ID, "already-resumed"), "who resumed")[0]
            assert "already resumed by" in notice.text and "admin" in notice.text, notice.text
            browser.find_element(By.ID, "logout").click()
            wait_for(lambda: browser.find_elements(By.ID, "login-form"), "the login page after logging out")
        finally:
            process.stop()
