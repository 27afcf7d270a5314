#!/bin/sh
# CI setup for gdn-wgpu: Mesa's lavapipe, a Vulkan driver that runs on the CPU, and the Vulkan loader, so that
# `cargo test` runs the whole conformance suite on the wgpu backend (both reduction paths) on a machine with no
# GPU. Debian/Ubuntu. Without these packages the wgpu tests skip themselves ("SKIPPED ...: backend unavailable").
set -eu
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; else SUDO=; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends mesa-vulkan-drivers libvulkan1 >/dev/null
# Mesa's window-system code complains on stderr when this is unset; harmless, but noisy in test logs
echo "gdn-wgpu: lavapipe installed; set XDG_RUNTIME_DIR (e.g. /tmp) to quiet Mesa's warnings"
