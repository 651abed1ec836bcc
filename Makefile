# Entry points; the work is done by the scripts in scripts/ (see docs/development.md).
.PHONY: demo test services-up services-down services-status services-reset

# Start the local stack, then run the main job.
demo:
	@bash scripts/demo.sh

# Start the local stack, then build and run the whole workspace test suite.
test:
	@bash scripts/test.sh

services-up:
	@bash scripts/services.sh up

services-down:
	@bash scripts/services.sh down

services-status:
	@bash scripts/services.sh status

# Stop the stack and delete all local data (.local/).
services-reset:
	@bash scripts/services.sh reset
