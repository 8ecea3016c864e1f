/* Connect (import a peer's touched memfd pool) + first 4 KiB write, then the
 * demo's workload: 64 requests x 512 x 16 KiB pages to shuffled slots, 8 in flight. */
#define _GNU_SOURCE
#include "aioxfer.h"
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
static double ms(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e3+t.tv_nsec/1e6;}
static int wait_one(axf_engine*e){for(;;){axf_completion c[16];size_t n=axf_wait(e,50);if(!n){struct pollfd pf={.fd=axf_engine_fd(e),.events=POLLIN};poll(&pf,1,1000);}n=axf_poll(e,c,16);int d=0;for(size_t k=0;k<n;k++){if(c[k].kind==AXF_CQ_XFER){d++;if(c[k].status)fprintf(stderr,"status %d\n",c[k].status);}axf_completion_free(&c[k]);}if(d)return d;}}
int main(int argc,char**argv){
  size_t POOL=(size_t)atoi(argv[1])<<20; int REQ=64,PG=512; size_t PS=16384;
  axf_engine*a=axf_engine_create(NULL),*b=axf_engine_create(NULL);
  int mfd=memfd_create("pool",MFD_CLOEXEC|MFD_ALLOW_SEALING); ftruncate(mfd,POOL); fcntl(mfd,F_ADD_SEALS,F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL);
  uint8_t*pool=mmap(0,POOL,PROT_READ|PROT_WRITE,MAP_SHARED,mfd,0); memset(pool,0,POOL);
  uint64_t brid,bkey,arid,akey,ep; axf_region_register(b,pool,POOL,AXF_ACCESS_READ|AXF_ACCESS_WRITE,mfd,&brid,&bkey);
  size_t SRC=(size_t)REQ*PG*PS; uint8_t*src=malloc(SRC); memset(src,3,SRC);
  axf_region_register(a,src,SRC,AXF_ACCESS_READ|AXF_ACCESS_WRITE,-1,&arid,&akey);
  axf_endpoint_create(a,AXF_EP_SHM,1,getpid(),-1,&ep);
  double t0=ms();
  axf_endpoint_import(a,ep,brid,bkey,POOL,AXF_ACCESS_READ|AXF_ACCESS_WRITE,0,mfd);
  axf_desc d1={.lrid=arid,.rrid=brid,.rkey=bkey,.roff=POOL/2,.len=4096};
  axf_post(a,ep,AXF_OP_WRITE,&d1,1,NULL,0,1,0); wait_one(a);
  double tc=ms()-t0;
  size_t slots=POOL/PS; uint32_t*perm=malloc(slots*4); for(size_t i=0;i<slots;i++)perm[i]=(uint32_t)i; srand(1); for(size_t i=slots-1;i>0;i--){size_t j=(size_t)rand()%(i+1);uint32_t t=perm[i];perm[i]=perm[j];perm[j]=t;}
  axf_desc*d=malloc(sizeof(axf_desc)*PG);
  int inflight=0; double ts=ms();
  for(int r=0;r<REQ;r++){
    for(int p=0;p<PG;p++){size_t k=((size_t)r*PG+p)%slots; d[p]=(axf_desc){.lrid=arid,.loff=((size_t)r*PG+p)*PS,.rrid=brid,.rkey=bkey,.roff=(uint64_t)perm[k]*PS,.len=PS};}
    while(inflight>=8) inflight-=wait_one(a);
    if(axf_post(a,ep,AXF_OP_WRITE,d,PG,NULL,0,100+r,0)){fprintf(stderr,"post\n");return 1;} inflight++;
  }
  while(inflight>0) inflight-=wait_one(a);
  double tw=ms()-ts;
  printf("pool %zu MiB: connect+first 4KiB %.2f ms; demo window %.1f ms = %.2f GB/s\n",POOL>>20,tc,tw,SRC/tw/1e6);
  axf_engine_destroy(a); axf_engine_destroy(b); return 0;}
