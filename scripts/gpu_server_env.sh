# Sourced by the GPU scripts that run tritonserver on a machine without registry access:
# unpacks .whl/triton_min.tar.xz (the nvidia-pytriton wheel's server, Python backend, 3.12 stub
# and libraries) and .whl/tritonclient_py.tar.gz into /tmp/site, and makes /tmp/venv: a venv
# that sees the machine's packages through a .pth file (the machine's python3 is itself a
# venv, so --system-site-packages would not) with numpy 1.26 and rapidjson in front, because
# tritonserver 2.51's Python-backend stub misreads BYTES inputs under numpy 2.
# After sourcing: PYTHONPATH has /tmp/site and the checkout; run the server with /tmp/venv/bin/python.
mkdir -p /tmp/site
tar xJf .whl/triton_min.tar.xz -C /tmp/site || return 1
[ -f .whl/tritonclient_py.tar.gz ] && { tar xzf .whl/tritonclient_py.tar.gz -C /tmp/site || return 1; }
base_site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
[ -x /tmp/venv/bin/python ] || python3 -m venv --without-pip /tmp/venv || return 1
venv_site=$(/tmp/venv/bin/python -c 'import site; print(site.getsitepackages()[0])')
python3 -m pip install -q --no-index --no-deps --upgrade --target "$venv_site" .whl/numpy-1.26*.whl \
  $(ls .whl/python_rapidjson-*.whl 2>/dev/null) || return 1
echo "$base_site" > "$venv_site/zz_machine_packages.pth"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
