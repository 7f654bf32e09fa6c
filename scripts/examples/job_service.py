"""A fine-tuning job service on runner.api, served by `uvicorn --app-dir scripts/examples
job_service:app` (tests/test_api.py drives it). POST /jobs ["max_steps=100", ...] validates and
launches; GET /jobs/ID (status), /jobs/ID/metrics, /jobs/ID/logs (streamed until the run ends);
DELETE /jobs/ID stops it with a checkpoint; POST /jobs/ID/resume continues it. Jobs live in memory
here; a real service keeps each job's run directory (api.Run(path) reattaches) in its database.
"""

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse

from runner import api
from runner.errors import UserError

app = FastAPI(title="runner jobs")
jobs: dict[str, api.Run] = {}


@app.exception_handler(UserError)
def refused(request: Request, err: UserError) -> JSONResponse:
    """E.g. stopping a job that has ended: the message names what and why."""
    return JSONResponse({"detail": str(err)}, status_code=409)


def job(job_id: str) -> api.Run:
    if job_id not in jobs:
        raise HTTPException(404, f"no job {job_id}")
    return jobs[job_id]


@app.post("/jobs", status_code=201)
def create(overrides: list[str]) -> dict:
    if problems := api.validate(overrides):
        raise HTTPException(422, [str(problem) for problem in problems])
    try:
        run = api.launch(overrides)
    except UserError as err:  # what a launch alone refuses (hydra.run.dir=, resume=): a bad request
        raise HTTPException(422, [str(err)]) from None
    jobs[run.path.name] = run
    return {"id": run.path.name, "run_dir": str(run.path)}


@app.get("/jobs/{job_id}")
def status(job_id: str) -> dict:
    return job(job_id).status().to_json()


@app.get("/jobs/{job_id}/metrics")
def metrics(job_id: str) -> list[dict]:
    return job(job_id).metrics()


@app.get("/jobs/{job_id}/logs")
def logs(job_id: str) -> StreamingResponse:
    lines = job(job_id).logs(follow=True)
    return StreamingResponse((line + "\n" async for line in lines), media_type="text/plain")


@app.delete("/jobs/{job_id}")
def stop(job_id: str) -> dict:
    return job(job_id).stop(save_checkpoint=True).to_json()


@app.post("/jobs/{job_id}/resume")
def resume(job_id: str) -> dict:
    return job(job_id).resume().status().to_json()
