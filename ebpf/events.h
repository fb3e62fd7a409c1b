// Shared settings for Sentinel's BPF programs (kernel side). Struct layouts that user space
// reads are declared in each program and mirrored with ctypes in sentinel/sources/.
#ifndef SENTINEL_EVENTS_H
#define SENTINEL_EVENTS_H

#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 64
#endif

#endif
