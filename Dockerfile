# commlens: API + dashboard (`commlens serve`), the dashboard alone (`commlens ui`), and with
# --build-arg EXTRAS=harness the training harness (torch from the package index; CUDA builds on GPU hosts).
FROM python:3.11-slim

ARG EXTRAS=""
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY commlens ./commlens
COPY ingest ./ingest
COPY backend ./backend
COPY frontend ./frontend
COPY harness ./harness
RUN pip install ".${EXTRAS:+[$EXTRAS]}" && useradd --create-home --uid 1000 commlens \
    && mkdir -p /data /runs && chown commlens /data /runs

USER commlens
WORKDIR /data
EXPOSE 8050 8051
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s \
  CMD python -c "import sys, httpx; sys.exit(httpx.get('http://127.0.0.1:8050/api/health').status_code != 200)" || exit 1
CMD ["commlens", "serve", "--db", "/data/commlens.duckdb", "--host", "0.0.0.0", "--port", "8050", "--insecure"]
