/*
 * A fake NVIDIA driver library for tests: built as libnvidia-ml.so.1 and loaded by the REAL nvidia-ml-py
 * (pynvml) through LD_LIBRARY_PATH, so pynvml's own ctypes code marshals every call, exactly as it does
 * against a driver. Only the functions gputopo calls exist; pynvml answers FunctionNotFound for the rest
 * (its _nvmlGetFunctionPointer turns a missing symbol into NVML_ERROR_FUNCTION_NOT_FOUND). Built with
 * -DOLD_DRIVER it also lacks functions that older drivers lack (memory v2, MIG, NUMA node id, remote
 * NVLink device type, the v3 process lists, the clocks *event* reasons name (it has the older throttle
 * name), remapped rows, the GPU fabric info, platform info and C2C mode).
 *
 * The machine is described by the text file named in FAKE_NVML_CONFIG, read at nvmlInit; without it the
 * library answers DriverNotLoaded. One statement per line, '#' starts a comment:
 *
 *   driver VERSION | cuda INT                       system versions
 *   init CODE | hang-init                           nvmlInit fails / never returns
 *   gpu I BUS UUID MINOR NAME...                    a GPU (index I; NAME is the rest of the line)
 *   handle I CODE                                   nvmlDeviceGetHandleByIndex_v2(I) fails with CODE
 *   pcie I GEN_CUR GEN_MAX WIDTH_CUR WIDTH_MAX
 *   mem I TOTAL_MIB USED_MIB RESERVED_MIB           v1 "used" is USED + RESERVED, as real drivers report
 *   util I PCT | numaid I N | cpus I HEXWORD... | nodes I HEXWORD...
 *   mig I CURRENT PENDING | migdev I SLOT UUID
 *   link I L STATE REMOTE_BUS REMOTE_TYPE           REMOTE_BUS "-": the remote PCI query says NotFound
 *   proc I PID USED_MIB
 *   path A B LEVEL | p2p A B STATUS                 pair answers (default: SYSTEM, P2P OK)
 *   err I|* FUNCTION CODE                           FUNCTION fails with CODE for GPU I (or every GPU)
 *   hang I|* FUNCTION                               FUNCTION never returns for GPU I (or every GPU)
 *
 * Health (each unset value answers NotSupported):
 *   ecc I CURRENT PENDING                           ECC mode (1 on, 0 off)
 *   eccerr I VOL_CORR VOL_UNC AGG_CORR AGG_UNC      nvmlDeviceGetTotalEccErrors
 *   retired I SBE DBE PENDING                       retired pages (counts) and pending status (pre-Ampere)
 *   remap I CORR UNC PENDING FAILURE                nvmlDeviceGetRemappedRows (Ampere+)
 *   clocks I HEXMASK                                clocks event reasons (0x8 HW slowdown, ...)
 *   temp I C | power I MILLIWATTS LIMIT_MILLIWATTS | replay I N | persist I 0|1 | vbios I TEXT
 *   serial I TEXT                                   the board serial (nvmlDeviceGetSerial)
 *   nverr I L REPLAY RECOVERY CRC_FLIT CRC_DATA     NVLink error counters of link L
 *   field I ID VALUE [STEP] | fielderr I ID CODE    nvmlDeviceGetFieldValues: per-field value (any scopeId;
 *                                                   rising by STEP at each read) or return code (a field
 *                                                   not set answers NotSupported in its own slot)
 *   unrepairable I 0|1                              nvmlDeviceGetUnrepairableMemoryFlag_v1 (newer drivers)
 *   lfield I L ID VALUE [STEP]                      a field scoped to NVLink L (scopeId L: the NVLink5 error
 *                                                   counters), rising by STEP at each read
 *   fabric I STATE STATUS CLIQUE HEALTHMASK         nvmlDeviceGetGpuFabricInfo(V) (V: the v2 struct only; a
 *                                                   v3 struct answers ArgumentVersionMismatch)
 *   fabricv3 I CLUSTER_UUID SUMMARY                 the driver also answers the v3 struct: the 8-4-4-4-12
 *                                                   cluster UUID (in v1 and v2 too) and the health summary
 *   cliques I TYPE:ID...                            nvmlDeviceGetGpuFabricInfo_v4's clique list (a GPU
 *                                                   without one answers NotSupported)
 *   platform I SERIAL|- SLOT TRAY HOST PEER MODULE  nvmlDeviceGetPlatformInfo (v2 struct); "-": no serial
 *   c2c I 0|1                                       nvmlDeviceGetC2cModeInfoV
 *   rise I COUNTER STEP [L]                         COUNTER rises by STEP at each read: ecc_vol_corr,
 *                                                   ecc_vol_unc, ecc_agg_corr, ecc_agg_unc, pcie_replay, or
 *                                                   nvl_replay/nvl_recovery/nvl_crc_flit/nvl_crc_data of link L
 *
 * Events (nvmlEventSetCreate, nvmlDeviceRegisterEvents, nvmlEventSetWait_v2, nvmlEventSetFree,
 * nvmlDeviceGetSupportedEventTypes; every GPU supports the Xid critical error type unless told):
 *   xid I CODE AFTER_WAITS                          an Xid CODE event on GPU I, answered by the AFTER_WAITS-th
 *                                                   nvmlEventSetWait_v2 of a set where GPU I is registered
 *                                                   for Xid (the waits before it time out after their
 *                                                   timeout); each is delivered once
 *   noevents I                                      GPU I supports no event type
 *
 * nvmlInit and nvmlShutdown are reference-counted as NVML's are: the machine file is read by the first
 * nvmlInit and the library stays initialised until as many nvmlShutdown calls.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int nvmlReturn_t;
#define OK 0
#define E_UNINIT 1
#define E_INVALID 2
#define E_NOT_SUPPORTED 3
#define E_NOT_FOUND 6
#define E_INSUFFICIENT_SIZE 7
#define E_DRIVER_NOT_LOADED 9

#define MAXG 16
#define MAXL 18
#define MAXRULES 64
#define MAXMIG 7
#define MAXPROC 8

typedef struct {
    int kind; /* 1: GPU, 2: MIG device */
    int index;
    int slot;
} handle_t;

typedef struct {
    int state, type, present;
    char bus[32];
} link_t;

/* Counter ids for "rise": ECC 0-3, PCIe replays 4, NVLink 8 + link * 4 + kind. */
#define NCOUNTERS (8 + MAXL * 4)
#define MAXFIELDS 64

typedef struct {
    int present, handle_err, minor, numaid, util;
    /* health */
    int has_ecc, ecc_cur, ecc_pend, has_eccerr, has_retired, has_remap, has_clocks, has_temp, has_power;
    int has_replay, has_persist, persist, has_fabric, nfields, has_unrepairable, unrepairable;
    unsigned long long eccerr[4], clocks;
    unsigned retired[3], remap[4], temp, power_mw, limit_mw, replay;
    unsigned fabric_state, fabric_clique, fabric_mask;
    int fabric_status, has_fabric_v3, fabric_summary, ncliques, has_platform, has_c2c, c2c;
    unsigned char fabric_uuid[16], platform_serial[16], platform_byte[5];
    unsigned clique_type[64], clique_id[64];
    char vbios[64];
    char serial[64];
    int has_nverr[MAXL];
    unsigned long long nverr[MAXL][4];
    long long rise[NCOUNTERS];
    unsigned field_id[MAXFIELDS];
    long long field_val[MAXFIELDS];
    int field_ret[MAXFIELDS];
    int field_scope[MAXFIELDS]; /* -1: any scope; else the NVLink the field is scoped to */
    long long field_step[MAXFIELDS], field_reads[MAXFIELDS];
    char bus[32], uuid[96], name[96];
    unsigned gen_cur, gen_max, width_cur, width_max;
    unsigned long long total, used, reserved;
    unsigned long long cpus[16], nodes[4];
    int ncpus, nnodes;
    int mig_cur, mig_pending, has_mig;
    char mig_uuid[MAXMIG][96];
    int nproc;
    unsigned proc_pid[MAXPROC];
    unsigned long long proc_mem[MAXPROC];
    link_t links[MAXL];
    handle_t handle;
    handle_t mig_handle[MAXMIG];
} gpu_t;

typedef struct {
    int gpu; /* -1: every GPU */
    int hang;
    int code;
    char fn[80];
} rule_t;

static gpu_t gpus[MAXG];
static int ngpus, init_code, init_hang, inited;
/* How often each counter was read: kept across nvmlInit/nvmlShutdown so counters rise between samples. */
static unsigned long long reads[MAXG][NCOUNTERS];
static char driver[80] = "550.54.15";
static int cuda = 12040;
static int path_level[MAXG][MAXG], p2p_status[MAXG][MAXG], path_set[MAXG][MAXG];
static rule_t rules[MAXRULES];
static int nrules;

#define E_TIMEOUT 10
#define EVENT_XID 0x8ULL
#define MAXXID 8
typedef struct {
    int gpu, after, delivered;
    unsigned long long code;
} xid_t;
static xid_t xids[MAXXID];
static int nxids, noevents[MAXG];
typedef struct {
    unsigned long long types[MAXG];
    int waits;
} eventset_t;

static void hang_forever(void) {
    for (;;) pause();
}

static int counter_id(const char *name, int link) {
    static const char *names[] = {"ecc_vol_corr", "ecc_vol_unc", "ecc_agg_corr", "ecc_agg_unc", "pcie_replay"};
    static const char *nvl[] = {"nvl_replay", "nvl_recovery", "nvl_crc_flit", "nvl_crc_data"};
    for (int k = 0; k < 5; k++)
        if (!strcmp(name, names[k])) return k;
    for (int k = 0; k < 4; k++)
        if (!strcmp(name, nvl[k]) && link >= 0 && link < MAXL) return 8 + link * 4 + k;
    return -1;
}

/* The health statements of the machine file; 1 when the line was one. */
static int parse_health(const char *key, const char *line) {
    int i = -1, x = 0, y = 0, z = 0, w = 0, n = 0;
    unsigned long long a = 0, b = 0, c = 0, d = 0;
    char name[64];
    if (sscanf(line, "%*s %d", &i) != 1 || i < 0 || i >= MAXG) return 0;
    gpu_t *g = &gpus[i];
    if (!strcmp(key, "ecc") && sscanf(line, "%*s %*d %d %d", &x, &y) == 2) {
        g->has_ecc = 1, g->ecc_cur = x, g->ecc_pend = y;
    } else if (!strcmp(key, "eccerr") && sscanf(line, "%*s %*d %llu %llu %llu %llu", &a, &b, &c, &d) == 4) {
        g->has_eccerr = 1, g->eccerr[0] = a, g->eccerr[1] = b, g->eccerr[2] = c, g->eccerr[3] = d;
    } else if (!strcmp(key, "retired") && sscanf(line, "%*s %*d %d %d %d", &x, &y, &z) == 3) {
        g->has_retired = 1, g->retired[0] = x, g->retired[1] = y, g->retired[2] = z;
    } else if (!strcmp(key, "remap") && sscanf(line, "%*s %*d %d %d %d %d", &x, &y, &z, &w) == 4) {
        g->has_remap = 1, g->remap[0] = x, g->remap[1] = y, g->remap[2] = z, g->remap[3] = w;
    } else if (!strcmp(key, "clocks") && sscanf(line, "%*s %*d %llx", &a) == 1) {
        g->has_clocks = 1, g->clocks = a;
    } else if (!strcmp(key, "temp") && sscanf(line, "%*s %*d %d", &x) == 1) {
        g->has_temp = 1, g->temp = x;
    } else if (!strcmp(key, "power") && sscanf(line, "%*s %*d %d %d", &x, &y) == 2) {
        g->has_power = 1, g->power_mw = x, g->limit_mw = y;
    } else if (!strcmp(key, "replay") && sscanf(line, "%*s %*d %d", &x) == 1) {
        g->has_replay = 1, g->replay = x;
    } else if (!strcmp(key, "unrepairable") && sscanf(line, "%*s %*d %d", &x) == 1) {
        g->has_unrepairable = 1, g->unrepairable = x;
    } else if (!strcmp(key, "persist") && sscanf(line, "%*s %*d %d", &x) == 1) {
        g->has_persist = 1, g->persist = x;
    } else if (!strcmp(key, "vbios") && sscanf(line, "%*s %*d %63s", name) == 1) {
        snprintf(g->vbios, sizeof g->vbios, "%s", name);
    } else if (!strcmp(key, "serial") && sscanf(line, "%*s %*d %63s", name) == 1) {
        snprintf(g->serial, sizeof g->serial, "%s", name);
    } else if (!strcmp(key, "nverr") &&
               sscanf(line, "%*s %*d %d %llu %llu %llu %llu", &x, &a, &b, &c, &d) == 5 && x >= 0 && x < MAXL) {
        g->has_nverr[x] = 1;
        g->nverr[x][0] = a, g->nverr[x][1] = b, g->nverr[x][2] = c, g->nverr[x][3] = d;
    } else if ((!strcmp(key, "field") || !strcmp(key, "fielderr")) &&
               (n = sscanf(line, "%*s %*d %d %lld %lld", &x, (long long *)&a, (long long *)&b)) >= 2 &&
               g->nfields < MAXFIELDS) {
        g->field_id[g->nfields] = x;
        g->field_scope[g->nfields] = -1;
        g->field_val[g->nfields] = !strcmp(key, "field") ? (long long)a : 0;
        g->field_step[g->nfields] = !strcmp(key, "field") && n == 3 ? (long long)b : 0;
        g->field_ret[g->nfields++] = !strcmp(key, "field") ? OK : (int)a;
    } else if (!strcmp(key, "lfield") && (n = sscanf(line, "%*s %*d %d %d %lld %lld", &x, &y, (long long *)&a,
                                                     (long long *)&b)) >= 3 && g->nfields < MAXFIELDS) {
        g->field_id[g->nfields] = y;
        g->field_scope[g->nfields] = x;
        g->field_val[g->nfields] = (long long)a;
        g->field_step[g->nfields] = n == 4 ? (long long)b : 0;
        g->field_ret[g->nfields++] = OK;
    } else if (!strcmp(key, "fabric") && sscanf(line, "%*s %*d %d %d %d %x", &x, &y, &z, &w) == 4) {
        g->has_fabric = 1, g->fabric_state = x, g->fabric_status = y, g->fabric_clique = z;
        g->fabric_mask = (unsigned)w;
    } else if (!strcmp(key, "fabricv3") && sscanf(line, "%*s %*d %63s %d", name, &x) == 2) {
        unsigned char *u = g->fabric_uuid;
        int k = 0;
        for (const char *c = name; *c && k < 32; c++) {
            if (*c == '-') continue;
            unsigned v = (unsigned)(*c <= '9' ? *c - '0' : (*c | 0x20) - 'a' + 10);
            u[k / 2] = (unsigned char)(k % 2 ? u[k / 2] | v : v << 4);
            k++;
        }
        g->has_fabric_v3 = 1, g->fabric_summary = x;
    } else if (!strcmp(key, "cliques")) {
        const char *c = line;
        for (int skip = 0; skip < 2 && c; skip++) c = strchr(c + 1, ' ');
        while (c && g->ncliques < 64 && sscanf(c, " %d:%d", &x, &y) == 2) {
            g->clique_type[g->ncliques] = (unsigned)x, g->clique_id[g->ncliques++] = (unsigned)y;
            c = strchr(c + 1, ' ');
        }
    } else if (!strcmp(key, "platform") &&
               sscanf(line, "%*s %*d %63s %d %d %d %d %d", name, &x, &y, &z, &w, &n) == 6) {
        memset(g->platform_serial, 0, sizeof g->platform_serial);
        if (strcmp(name, "-")) strncpy((char *)g->platform_serial, name, sizeof g->platform_serial);
        g->has_platform = 1;
        g->platform_byte[0] = (unsigned char)x, g->platform_byte[1] = (unsigned char)y;
        g->platform_byte[2] = (unsigned char)z, g->platform_byte[3] = (unsigned char)w;
        g->platform_byte[4] = (unsigned char)n;
    } else if (!strcmp(key, "c2c") && sscanf(line, "%*s %*d %d", &x) == 1) {
        g->has_c2c = 1, g->c2c = x;
    } else if (!strcmp(key, "rise") && (n = sscanf(line, "%*s %*d %63s %d %d", name, &x, &y)) >= 2) {
        int id = counter_id(name, n == 3 ? y : -1);
        if (id >= 0) g->rise[id] = x;
    } else {
        return 0;
    }
    return 1;
}

/* A counter's value at this read: its base plus STEP for every earlier read ("rise"). */
static unsigned long long counter(int index, int id, unsigned long long base) {
    return base + (unsigned long long)gpus[index].rise[id] * reads[index][id]++;
}

static void load(const char *file) {
    FILE *f = fopen(file, "r");
    char line[512];
    memset(gpus, 0, sizeof gpus);
    memset(path_set, 0, sizeof path_set);
    ngpus = nrules = init_code = init_hang = nxids = 0;
    memset(noevents, 0, sizeof noevents);
    if (!f) {
        init_code = E_DRIVER_NOT_LOADED;
        return;
    }
    while (fgets(line, sizeof line, f)) {
        char *nl = strchr(line, '\n'), *hash = strchr(line, '#');
        char key[32], a[96], b[96];
        int i = 0, j = 0, n = 0, x = 0, y = 0, z = 0, w = 0;
        if (nl) *nl = 0;
        if (hash) *hash = 0;
        if (sscanf(line, "%31s", key) != 1) continue;
        if (!strcmp(key, "driver")) sscanf(line, "%*s %79s", driver);
        else if (!strcmp(key, "cuda")) sscanf(line, "%*s %d", &cuda);
        else if (!strcmp(key, "init")) sscanf(line, "%*s %d", &init_code);
        else if (!strcmp(key, "hang-init")) init_hang = 1;
        else if (!strcmp(key, "gpu") && sscanf(line, "%*s %d %95s %95s %d %n", &i, a, b, &x, &n) == 4 &&
                 i >= 0 && i < MAXG) {
            gpu_t *g = &gpus[i];
            g->present = 1;
            g->minor = x;
            g->numaid = -2; /* unset: NotSupported */
            strcpy(g->bus, a);
            strcpy(g->uuid, b);
            snprintf(g->name, sizeof g->name, "%s", line + n);
            g->handle.kind = 1;
            g->handle.index = i;
            if (i + 1 > ngpus) ngpus = i + 1;
        } else if (!strcmp(key, "handle") && sscanf(line, "%*s %d %d", &i, &x) == 2) gpus[i].handle_err = x;
        else if (!strcmp(key, "pcie") && sscanf(line, "%*s %d %d %d %d %d", &i, &x, &y, &z, &w) == 5) {
            gpus[i].gen_cur = x, gpus[i].gen_max = y, gpus[i].width_cur = z, gpus[i].width_max = w;
        } else if (!strcmp(key, "mem") && sscanf(line, "%*s %d %d %d %d", &i, &x, &y, &z) == 4) {
            gpus[i].total = (unsigned long long)x << 20;
            gpus[i].used = (unsigned long long)y << 20;
            gpus[i].reserved = (unsigned long long)z << 20;
        } else if (!strcmp(key, "util") && sscanf(line, "%*s %d %d", &i, &x) == 2) gpus[i].util = x;
        else if (!strcmp(key, "numaid") && sscanf(line, "%*s %d %d", &i, &x) == 2) gpus[i].numaid = x;
        else if ((!strcmp(key, "cpus") || !strcmp(key, "nodes")) && sscanf(line, "%*s %d %n", &i, &n) == 1) {
            int cpus = !strcmp(key, "cpus"), k = 0, used = 0;
            char *p = line + n;
            unsigned long long word;
            while (k < (cpus ? 16 : 4) && sscanf(p, "%llx%n", &word, &used) == 1) {
                if (cpus) gpus[i].cpus[k++] = word;
                else gpus[i].nodes[k++] = word;
                p += used;
            }
            if (cpus) gpus[i].ncpus = k;
            else gpus[i].nnodes = k;
        } else if (!strcmp(key, "mig") && sscanf(line, "%*s %d %d %d", &i, &x, &y) == 3) {
            gpus[i].has_mig = 1, gpus[i].mig_cur = x, gpus[i].mig_pending = y;
        } else if (!strcmp(key, "migdev") && sscanf(line, "%*s %d %d %95s", &i, &x, a) == 3 && x < MAXMIG) {
            strcpy(gpus[i].mig_uuid[x], a);
            gpus[i].mig_handle[x].kind = 2, gpus[i].mig_handle[x].index = i, gpus[i].mig_handle[x].slot = x;
        } else if (!strcmp(key, "link") && sscanf(line, "%*s %d %d %d %95s %d", &i, &j, &x, a, &y) == 5 &&
                   j < MAXL) {
            link_t *l = &gpus[i].links[j];
            l->present = 1, l->state = x, l->type = y;
            snprintf(l->bus, sizeof l->bus, "%.31s", strcmp(a, "-") ? a : "");
        } else if (!strcmp(key, "proc") && sscanf(line, "%*s %d %d %d", &i, &x, &y) == 3 &&
                   gpus[i].nproc < MAXPROC) {
            gpus[i].proc_pid[gpus[i].nproc] = x;
            gpus[i].proc_mem[gpus[i].nproc++] = (unsigned long long)y << 20;
        } else if (!strcmp(key, "path") && sscanf(line, "%*s %d %d %d", &i, &j, &x) == 3) {
            path_level[i][j] = path_level[j][i] = x;
            path_set[i][j] = path_set[j][i] = 1;
        } else if (!strcmp(key, "p2p") && sscanf(line, "%*s %d %d %d", &i, &j, &x) == 3) {
            p2p_status[i][j] = p2p_status[j][i] = x;
        } else if (!strcmp(key, "xid") && sscanf(line, "%*s %d %d %d", &i, &x, &y) == 3 && nxids < MAXXID &&
                   i >= 0 && i < MAXG) {
            xids[nxids].gpu = i, xids[nxids].code = (unsigned long long)x, xids[nxids].after = y;
            xids[nxids++].delivered = 0;
        } else if (!strcmp(key, "noevents") && sscanf(line, "%*s %d", &i) == 1 && i >= 0 && i < MAXG) {
            noevents[i] = 1;
        } else if (parse_health(key, line)) {
        } else if ((!strcmp(key, "err") || !strcmp(key, "hang")) && nrules < MAXRULES &&
                   sscanf(line, "%*s %95s %79s %d", a, rules[nrules].fn, &x) >= 2) {
            rules[nrules].gpu = strcmp(a, "*") ? atoi(a) : -1;
            rules[nrules].hang = !strcmp(key, "hang");
            rules[nrules].code = x;
            nrules++;
        }
    }
    fclose(f);
}

/* The configured answer of FUNCTION for GPU index (hangs here if told to); OK when nothing is set. */
/* FAKE_NVML_TRACE=FILE: every call on a GPU appends "FUNCTION INDEX" to FILE (in append mode, so the
 * worker processes of one command add to the same file): tests count how often a command reads. */
static void trace(const char *fn, int index) {
    static FILE *out;
    static int tried;
    if (!tried) {
        const char *path = getenv("FAKE_NVML_TRACE");
        tried = 1;
        if (path && *path) out = fopen(path, "a");
        if (out) setvbuf(out, NULL, _IOLBF, 0);
    }
    if (out) fprintf(out, "%s %d\n", fn, index);
}

static nvmlReturn_t rule(const char *fn, int index) {
    trace(fn, index);
    for (int k = 0; k < nrules; k++) {
        if ((strcmp(rules[k].fn, fn) && strcmp(rules[k].fn, "*")) || (rules[k].gpu != -1 && rules[k].gpu != index)) continue;
        if (rules[k].hang) hang_forever();
        return rules[k].code;
    }
    return OK;
}

#define GPU_OF(h)                                                                 \
    handle_t *hd = (handle_t *)(h);                                               \
    if (!inited) return E_UNINIT;                                                 \
    if (!hd || hd->index < 0 || hd->index >= ngpus) return E_INVALID;             \
    gpu_t *g = &gpus[hd->index];                                                  \
    (void)g;                                                                      \
    {                                                                             \
        nvmlReturn_t r_ = rule(__func__, hd->index);                              \
        if (r_) return r_;                                                        \
    }

nvmlReturn_t nvmlInitWithFlags(unsigned flags) {
    (void)flags;
    if (inited) {
        inited++;
        return OK;
    }
    load(getenv("FAKE_NVML_CONFIG") ? getenv("FAKE_NVML_CONFIG") : "");
    if (init_hang) hang_forever();
    if (init_code) return init_code;
    inited = 1;
    return OK;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlShutdown(void) {
    if (inited) inited--;
    return OK;
}

const char *nvmlErrorString(nvmlReturn_t code) {
    switch (code) {
    case 27: return "Not Ready";
    case 29: return "Invalid State";
    case 999: return "Unknown Error";
    default: return "Fake NVML error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *out, unsigned len) {
    if (!inited) return E_UNINIT;
    snprintf(out, len, "%s", driver);
    return rule(__func__, -1);
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *out) {
    if (!inited) return E_UNINIT;
    *out = cuda;
    return rule(__func__, -1);
}
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *out) {
    if (!inited) return E_UNINIT;
    *out = ngpus;
    return rule(__func__, -1);
}
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned index, void **out) {
    if (!inited) return E_UNINIT;
    if (index >= (unsigned)ngpus || !gpus[index].present) return E_INVALID;
    nvmlReturn_t r = rule(__func__, index);
    if (r) return r;
    if (gpus[index].handle_err) return gpus[index].handle_err;
    *out = &gpus[index].handle;
    return OK;
}

nvmlReturn_t nvmlDeviceGetName(void *h, char *out, unsigned len) {
    GPU_OF(h);
    snprintf(out, len, "%s", hd->kind == 2 ? "MIG 1g.10gb Device" : g->name);
    return OK;
}
nvmlReturn_t nvmlDeviceGetUUID(void *h, char *out, unsigned len) {
    GPU_OF(h);
    snprintf(out, len, "%s", hd->kind == 2 ? g->mig_uuid[hd->slot] : g->uuid);
    return OK;
}

typedef struct {
    char busIdLegacy[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} pci_t;

static void fill_pci(pci_t *p, const char *bus) {
    memset(p, 0, sizeof *p);
    snprintf(p->busId, sizeof p->busId, "%s", bus);
    snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "%s", strlen(bus) > 4 ? bus + 4 : bus);
}
nvmlReturn_t nvmlDeviceGetPciInfo_v3(void *h, pci_t *out) {
    GPU_OF(h);
    fill_pci(out, g->bus);
    return OK;
}
nvmlReturn_t nvmlDeviceGetMinorNumber(void *h, unsigned *out) {
    GPU_OF(h);
    *out = g->minor;
    return OK;
}
nvmlReturn_t nvmlDeviceGetCpuAffinity(void *h, unsigned size, unsigned long long *out) {
    GPU_OF(h);
    if (!g->ncpus) return E_NOT_SUPPORTED;
    for (unsigned k = 0; k < size; k++) out[k] = k < 16 ? g->cpus[k] : 0;
    return OK;
}
nvmlReturn_t nvmlDeviceGetMemoryAffinity(void *h, unsigned size, unsigned long long *out, int scope) {
    GPU_OF(h);
    (void)scope;
    if (!g->nnodes) return E_NOT_SUPPORTED;
    for (unsigned k = 0; k < size; k++) out[k] = k < 4 ? g->nodes[k] : 0;
    return OK;
}
#define UINT_FIELD(fname, field)                 \
    nvmlReturn_t fname(void *h, unsigned *out) { \
        GPU_OF(h);                               \
        if (!g->field) return E_NOT_SUPPORTED;   \
        *out = g->field;                         \
        return OK;                               \
    }
UINT_FIELD(nvmlDeviceGetCurrPcieLinkGeneration, gen_cur)
UINT_FIELD(nvmlDeviceGetMaxPcieLinkGeneration, gen_max)
UINT_FIELD(nvmlDeviceGetCurrPcieLinkWidth, width_cur)
UINT_FIELD(nvmlDeviceGetMaxPcieLinkWidth, width_max)

typedef struct {
    unsigned long long total, free, used;
} mem_v1_t;
typedef struct {
    unsigned version;
    unsigned long long total, reserved, free, used;
} mem_v2_t;

nvmlReturn_t nvmlDeviceGetMemoryInfo(void *h, mem_v1_t *out) {
    GPU_OF(h);
    out->total = g->total;
    out->used = g->used + g->reserved; /* v1 counts the driver's reservation as used */
    out->free = g->total - out->used;
    return OK;
}
#ifndef OLD_DRIVER
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(void *h, mem_v2_t *out) {
    GPU_OF(h);
    if (out->version != 0x02000028) return 25; /* NVML_ERROR_ARGUMENT_VERSION_MISMATCH */
    out->total = g->total;
    out->reserved = g->reserved;
    out->used = g->used;
    out->free = g->total - g->used - g->reserved;
    return OK;
}
nvmlReturn_t nvmlDeviceGetNumaNodeId(void *h, int *out) {
    GPU_OF(h);
    if (g->numaid == -2) return E_NOT_SUPPORTED;
    *out = g->numaid;
    return OK;
}
nvmlReturn_t nvmlDeviceGetMigMode(void *h, unsigned *cur, unsigned *pending) {
    GPU_OF(h);
    if (!g->has_mig) return E_NOT_SUPPORTED;
    *cur = g->mig_cur;
    *pending = g->mig_pending;
    return OK;
}
nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(void *h, unsigned *out) {
    GPU_OF(h);
    if (!g->has_mig) return E_NOT_SUPPORTED;
    *out = MAXMIG;
    return OK;
}
nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(void *h, unsigned slot, void **out) {
    GPU_OF(h);
    if (slot >= MAXMIG) return E_INVALID;
    if (!g->mig_uuid[slot][0]) return E_NOT_FOUND;
    *out = &g->mig_handle[slot];
    return OK;
}
nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(void *h, unsigned link, int *out) {
    GPU_OF(h);
    if (link >= MAXL || !g->links[link].present) return E_INVALID;
    *out = g->links[link].type;
    return OK;
}
#endif

nvmlReturn_t nvmlDeviceGetUtilizationRates(void *h, unsigned *out) {
    GPU_OF(h);
    out[0] = g->util;
    out[1] = 0;
    return OK;
}

typedef struct {
    unsigned pid;
    unsigned long long used;
    unsigned gi, ci;
} proc_t;

static nvmlReturn_t procs(gpu_t *g, unsigned *count, proc_t *out, int graphics) {
    unsigned n = graphics ? 0 : g->nproc;
    if (n == 0) {
        *count = 0;
        return OK;
    }
    if (!out || *count < n) {
        *count = n;
        return E_INSUFFICIENT_SIZE;
    }
    for (unsigned k = 0; k < n; k++) {
        out[k].pid = g->proc_pid[k];
        out[k].used = g->proc_mem[k];
        out[k].gi = out[k].ci = 0xFFFFFFFF;
    }
    *count = n;
    return OK;
}
#define PROCS(fname, graphics)                                     \
    nvmlReturn_t fname(void *h, unsigned *count, proc_t *out) {    \
        GPU_OF(h);                                                 \
        return procs(g, count, out, graphics);                     \
    }
#ifndef OLD_DRIVER
PROCS(nvmlDeviceGetComputeRunningProcesses_v3, 0)
PROCS(nvmlDeviceGetGraphicsRunningProcesses_v3, 1)
#endif
PROCS(nvmlDeviceGetComputeRunningProcesses_v2, 0)
PROCS(nvmlDeviceGetGraphicsRunningProcesses_v2, 1)

nvmlReturn_t nvmlDeviceGetNvLinkState(void *h, unsigned link, int *out) {
    GPU_OF(h);
    if (link >= MAXL || !g->links[link].present) return E_INVALID;
    *out = g->links[link].state;
    return OK;
}
nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(void *h, unsigned link, pci_t *out) {
    GPU_OF(h);
    if (link >= MAXL || !g->links[link].present) return E_INVALID;
    if (!g->links[link].bus[0]) return E_NOT_FOUND;
    fill_pci(out, g->links[link].bus);
    return OK;
}

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(void *h1, void *h2, int *out) {
    GPU_OF(h1);
    handle_t *other = (handle_t *)h2;
    nvmlReturn_t r = rule(__func__, other->index);
    if (r) return r;
    *out = path_set[hd->index][other->index] ? path_level[hd->index][other->index] : 50;
    return OK;
}
nvmlReturn_t nvmlDeviceGetP2PStatus(void *h1, void *h2, int cap, int *out) {
    GPU_OF(h1);
    (void)cap;
    handle_t *other = (handle_t *)h2;
    nvmlReturn_t r = rule(__func__, other->index);
    if (r) return r;
    *out = p2p_status[hd->index][other->index];
    return OK;
}

/* --- Health ------------------------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetVbiosVersion(void *h, char *out, unsigned len) {
    GPU_OF(h);
    if (!g->vbios[0]) return E_NOT_SUPPORTED;
    snprintf(out, len, "%s", g->vbios);
    return OK;
}
nvmlReturn_t nvmlDeviceGetSerial(void *h, char *out, unsigned len) {
    GPU_OF(h);
    if (!g->serial[0]) return E_NOT_SUPPORTED;
    snprintf(out, len, "%s", g->serial);
    return OK;
}
nvmlReturn_t nvmlDeviceGetEccMode(void *h, int *cur, int *pending) {
    GPU_OF(h);
    if (!g->has_ecc) return E_NOT_SUPPORTED;
    *cur = g->ecc_cur;
    *pending = g->ecc_pend;
    return OK;
}
/* errorType 0 corrected / 1 uncorrected; counterType 0 volatile / 1 aggregate (nvml.h). */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(void *h, int error_type, int counter_type, unsigned long long *out) {
    GPU_OF(h);
    if (!g->has_eccerr) return E_NOT_SUPPORTED;
    if (error_type < 0 || error_type > 1 || counter_type < 0 || counter_type > 1) return E_INVALID;
    int id = counter_type * 2 + error_type; /* vol_corr, vol_unc, agg_corr, agg_unc */
    *out = counter(hd->index, id, g->eccerr[id]);
    return OK;
}
nvmlReturn_t nvmlDeviceGetRetiredPages(void *h, int cause, unsigned *count, unsigned long long *addresses) {
    GPU_OF(h);
    if (!g->has_retired) return E_NOT_SUPPORTED;
    if (cause < 0 || cause > 1) return E_INVALID;
    unsigned n = g->retired[cause];
    if (!addresses || *count < n) {
        *count = n;
        return n ? E_INSUFFICIENT_SIZE : OK;
    }
    for (unsigned k = 0; k < n; k++) addresses[k] = 0x1000ULL * (k + 1) + cause;
    *count = n;
    return OK;
}
nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(void *h, int *out) {
    GPU_OF(h);
    if (!g->has_retired) return E_NOT_SUPPORTED;
    *out = g->retired[2] ? 1 : 0;
    return OK;
}
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(void *h, unsigned long long *out) {
    GPU_OF(h);
    if (!g->has_clocks) return E_NOT_SUPPORTED;
    *out = g->clocks;
    return OK;
}
nvmlReturn_t nvmlDeviceGetTemperature(void *h, int sensor, unsigned *out) {
    GPU_OF(h);
    if (!g->has_temp || sensor != 0) return E_NOT_SUPPORTED;
    *out = g->temp;
    return OK;
}
nvmlReturn_t nvmlDeviceGetPowerUsage(void *h, unsigned *out) {
    GPU_OF(h);
    if (!g->has_power) return E_NOT_SUPPORTED;
    *out = g->power_mw;
    return OK;
}
nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(void *h, unsigned *out) {
    GPU_OF(h);
    if (!g->has_power) return E_NOT_SUPPORTED;
    *out = g->limit_mw;
    return OK;
}
nvmlReturn_t nvmlDeviceGetPcieReplayCounter(void *h, unsigned *out) {
    GPU_OF(h);
    if (!g->has_replay) return E_NOT_SUPPORTED;
    *out = (unsigned)counter(hd->index, 4, g->replay);
    return OK;
}
#ifndef OLD_DRIVER
typedef struct {
    unsigned version, unrepairableMemory;
} unrepairable_t;

nvmlReturn_t nvmlDeviceGetUnrepairableMemoryFlag_v1(void *h, unrepairable_t *out) {
    GPU_OF(h);
    if (!g->has_unrepairable) return E_NOT_SUPPORTED;
    out->unrepairableMemory = (unsigned)g->unrepairable;
    return OK;
}
#endif

nvmlReturn_t nvmlDeviceGetPersistenceMode(void *h, int *out) {
    GPU_OF(h);
    if (!g->has_persist) return E_NOT_SUPPORTED;
    *out = g->persist;
    return OK;
}
/* counter: 0 replay, 1 recovery, 2 CRC flit, 3 CRC data (NVML_NVLINK_ERROR_DL_*). */
nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(void *h, unsigned link, int kind, unsigned long long *out) {
    GPU_OF(h);
    if (link >= MAXL || !g->links[link].present) return E_INVALID;
    if (!g->has_nverr[link] || kind < 0 || kind > 3) return E_NOT_SUPPORTED;
    *out = counter(hd->index, 8 + (int)link * 4 + kind, g->nverr[link][kind]);
    return OK;
}

typedef struct {
    unsigned fieldId, scopeId;
    long long timestamp, latencyUsec;
    int valueType, nvmlReturn;
    union {
        double d;
        unsigned ui;
        unsigned long ul;
        unsigned long long ull;
        long long sll;
        int si;
        unsigned short us;
    } value;
} field_t;

nvmlReturn_t nvmlDeviceGetFieldValues(void *h, int count, field_t *values) {
    GPU_OF(h);
    for (int k = 0; k < count; k++) {
        field_t *v = &values[k];
        v->nvmlReturn = E_NOT_SUPPORTED;
        v->valueType = 3; /* unsigned long long */
        v->value.ull = 0;
        for (int f = 0; f < g->nfields; f++) {
            if (g->field_id[f] != v->fieldId) continue;
            if (g->field_scope[f] >= 0 && (unsigned)g->field_scope[f] != v->scopeId) continue;
            v->nvmlReturn = g->field_ret[f];
            v->value.ull = (unsigned long long)(g->field_val[f] + g->field_step[f] * g->field_reads[f]++);
        }
    }
    return OK;
}

#ifndef OLD_DRIVER
nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(void *h, unsigned long long *out) {
    GPU_OF(h);
    if (!g->has_clocks) return E_NOT_SUPPORTED;
    *out = g->clocks;
    return OK;
}
nvmlReturn_t nvmlDeviceGetRemappedRows(void *h, unsigned *corr, unsigned *unc, unsigned *pending,
                                       unsigned *failure) {
    GPU_OF(h);
    if (!g->has_remap) return E_NOT_SUPPORTED;
    *corr = g->remap[0], *unc = g->remap[1], *pending = g->remap[2], *failure = g->remap[3];
    return OK;
}

/* The layouts of nvml.h (NVIDIA/go-nvml pkg/nvml/nvml.h, r580): nvmlGpuFabricState_t is an unsigned char;
 * v2 is 36 bytes (nvmlGpuFabricInfo_v2 = 0x02000024), v3 40 (0x03000028); the v4 struct (nvidia-ml-py
 * 13.615) has no version word; nvmlPlatformInfo_v2_t is 44 bytes (0x0200002c). */
typedef struct {
    unsigned char clusterUuid[16];
    int status;
    unsigned cliqueId;
    unsigned char state;
} fabric_v1_t;
typedef struct {
    unsigned version;
    unsigned char clusterUuid[16];
    int status;
    unsigned cliqueId;
    unsigned char state;
    unsigned healthMask;
    unsigned char healthSummary; /* v3 only */
} fabric_v3_t;
typedef struct {
    unsigned char type;
    unsigned id;
} fabric_clique_t;
typedef struct {
    unsigned char clusterUuid[16];
    int status;
    fabric_clique_t cliques[64];
    unsigned numCliques;
    unsigned char state;
    unsigned healthMask;
    unsigned char healthSummary;
} fabric_v4_t;
typedef struct {
    unsigned version;
    unsigned char ibGuid[16], chassisSerialNumber[16];
    unsigned char slotNumber, trayIndex, hostId, peerType, moduleId;
} platform_v2_t;
typedef struct {
    unsigned isC2cEnabled;
} c2c_mode_t;

nvmlReturn_t nvmlDeviceGetGpuFabricInfo(void *h, fabric_v1_t *out) {
    GPU_OF(h);
    if (!g->has_fabric) return E_NOT_SUPPORTED;
    memset(out, 0, sizeof *out);
    memcpy(out->clusterUuid, g->fabric_uuid, 16);
    out->status = g->fabric_status, out->cliqueId = g->fabric_clique, out->state = (unsigned char)g->fabric_state;
    return OK;
}
nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(void *h, fabric_v3_t *out) {
    GPU_OF(h);
    int v3 = out->version == 0x03000028 && sizeof *out == 40;
    if (out->version != 0x02000024 && !(v3 && g->has_fabric_v3)) return 25; /* ARGUMENT_VERSION_MISMATCH */
    if (!g->has_fabric) return E_NOT_SUPPORTED;
    memcpy(out->clusterUuid, g->fabric_uuid, 16);
    out->status = g->fabric_status, out->cliqueId = g->fabric_clique, out->state = (unsigned char)g->fabric_state;
    out->healthMask = g->fabric_mask;
    if (v3) out->healthSummary = (unsigned char)g->fabric_summary;
    return OK;
}
nvmlReturn_t nvmlDeviceGetGpuFabricInfo_v4(void *h, fabric_v4_t *out) {
    GPU_OF(h);
    if (!g->has_fabric || !g->ncliques) return E_NOT_SUPPORTED;
    memset(out, 0, sizeof *out);
    memcpy(out->clusterUuid, g->fabric_uuid, 16);
    out->status = g->fabric_status, out->state = (unsigned char)g->fabric_state;
    out->healthMask = g->fabric_mask, out->healthSummary = (unsigned char)g->fabric_summary;
    out->numCliques = (unsigned)g->ncliques;
    for (int k = 0; k < g->ncliques; k++)
        out->cliques[k].type = (unsigned char)g->clique_type[k], out->cliques[k].id = g->clique_id[k];
    return OK;
}
nvmlReturn_t nvmlDeviceGetPlatformInfo(void *h, platform_v2_t *out) {
    GPU_OF(h);
    if (out->version != (sizeof *out | 2u << 24)) return 25;
    if (!g->has_platform) return E_NOT_SUPPORTED;
    memset(out->ibGuid, 0, sizeof out->ibGuid);
    memcpy(out->chassisSerialNumber, g->platform_serial, 16);
    out->slotNumber = g->platform_byte[0], out->trayIndex = g->platform_byte[1];
    out->hostId = g->platform_byte[2], out->peerType = g->platform_byte[3], out->moduleId = g->platform_byte[4];
    return OK;
}
nvmlReturn_t nvmlDeviceGetC2cModeInfoV(void *h, c2c_mode_t *out) {
    GPU_OF(h);
    if (!g->has_c2c) return E_NOT_SUPPORTED;
    out->isC2cEnabled = (unsigned)g->c2c;
    return OK;
}
#endif

/* --- Events ------------------------------------------------------------------------------------------ */

typedef struct {
    void *device;
    unsigned long long eventType, eventData;
    unsigned gpuInstanceId, computeInstanceId;
} event_data_t;

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(void *h, unsigned long long *out) {
    GPU_OF(h);
    *out = noevents[hd->index] ? 0 : EVENT_XID | 0x1ULL | 0x2ULL;
    return OK;
}
nvmlReturn_t nvmlEventSetCreate(eventset_t **out) {
    if (!inited) return E_UNINIT;
    *out = calloc(1, sizeof **out);
    return *out ? OK : E_INVALID;
}
nvmlReturn_t nvmlDeviceRegisterEvents(void *h, unsigned long long types, eventset_t *set) {
    GPU_OF(h);
    if (!set) return E_INVALID;
    if (noevents[hd->index]) return E_NOT_SUPPORTED;
    set->types[hd->index] |= types;
    return OK;
}
nvmlReturn_t nvmlEventSetWait_v2(eventset_t *set, event_data_t *data, unsigned timeout_ms) {
    if (!inited) return E_UNINIT;
    if (!set || !data) return E_INVALID;
    set->waits++;
    for (int k = 0; k < nxids; k++) {
        xid_t *x = &xids[k];
        if (x->delivered || set->waits < x->after || !(set->types[x->gpu] & EVENT_XID)) continue;
        x->delivered = 1;
        memset(data, 0, sizeof *data);
        data->device = &gpus[x->gpu].handle;
        data->eventType = EVENT_XID;
        data->eventData = x->code;
        return OK;
    }
    usleep((useconds_t)timeout_ms * 1000);
    return E_TIMEOUT;
}
nvmlReturn_t nvmlEventSetFree(eventset_t *set) {
    free(set);
    return OK;
}
