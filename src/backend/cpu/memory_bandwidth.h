// The machine's measured copy bandwidth: the roofline `kiln bench` compares decode against.
#pragma once

namespace kiln::cpu {

// GB/s (1e9 bytes per second, bytes read + bytes written) of a multi-threaded memcpy over
// buffers at least twice the last-level cache, at least 1 GiB of traffic per timed run, best of
// several runs. Takes about a second and allocates two buffers of that size.
double measure_copy_bandwidth_gbps(int threads);

}  // namespace kiln::cpu
